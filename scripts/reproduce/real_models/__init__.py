"""The paper's two claims on real pretrained models (docs/reproduction.md, "Real models"), and the
committed records of the earlier small-scale studies.

Modules:

- ``records``: the third LongPPL attempt's and the three-setting LongCE study's published tables,
  transcribed into machine-readable records under ``docs/records/`` (``transcribe``), and the
  report that rebuilds every table, and the statistics those records allow, from them alone
  (``report``).
- ``members``: the population's members built from the real models: Gemma 3 270M with its full
  attention layers limited to a window ``w``, with RoPE scaled beyond its training, and SmolLM2-135M
  extended by PI / NTK / YaRN.
- ``tasks``: the task documents (lines, needle, passage recall) at 4k-32k tokens with the real
  tokenizers, each case with its answer's distance from the question.
- ``phases``: the phases (``prepare`` on CPUs; ``calibrate``, ``instrument``, ``finetune``,
  ``score`` on the device), each appending one JSON line per finished unit to a records file and
  skipping the units already there.
- ``analysis``: the LongPPL plan's statistics and decision, from those records alone.
- ``longce_start``: the device phases of "LongCE from a real start" (starts and gate, the start
  model's weights, the five arms' training, every checkpoint's outcomes).
- ``longce_chain``: its ``longce-chain`` stage, the training and the evaluations in one pipeline a
  device shared by processes side by side, and the time estimates by which it begins a unit.
- ``longce_report``: that plan's statistics and decisions, from its records alone.
- ``cli``: the command line; its ``STAGES`` table maps each stage's name to its function.

The shared pieces (tasks, calibration, statistics, scoring, the arms' paired comparison) come from
``longppl_reproduce.common`` and ``longppl``.
"""
