"""``longppl_reproduce``: the paper's claims reproduced at small scale, kept outside both libraries.

It imports ``longppl`` (scoring, caches, command helpers) and ``longce`` (the trainer); neither of them
imports it, as torchtune keeps its ``recipes/`` apart from the ``torchtune`` package.

Laid out by experiment, the arrows running down (tests/test_package_boundaries.py keeps them so):

- ``common/``: what every experiment shares. The tasks (``lines``, LongEval's "lines" task;
  ``needle``, multi-key needle-in-a-haystack; ``two_hop``; ``passage_recall``; ``answer_tokens``,
  the paper's Figure 5(b): are the answer's tokens key tokens), the model family (``family``:
  tokenizer, models, training), the stages both experiments run (``stages``: data, pretraining
  through a gate, context extension, key-token caches, calibration), ``statistics`` (bootstrap
  intervals, Williams' t, partial correlation, a random-intercept model), the run folder
  (``run_folder``), ``books`` (reading the corpus), ``corpus_chunks`` (book chunks and null
  documents), ``calibration`` (alpha against the null), the config pieces (``config``),
  ``report_text``, ``fine_tuning`` (the in-order LongCE trainer and the step timer) and
  ``claim_statistics`` (the statistics and decision rule of the LongPPL claim, shared by the
  population and the real models). It imports no experiment.
- ``population/``: LongPPL against long-context ability over a population of context extensions of
  one base model (``longppl-reproduce``): ``pipeline`` (its stage table and command line),
  ``models`` (members trained, evaluated, exported), ``analysis`` and ``report`` (the second plan),
  ``third_attempt`` (the third plan's analysis and report).
- ``longce_comparison/``: LongCE against CE from the population's base (``longppl-reproduce-longce``):
  ``pipeline`` (its stage table and command line), ``config``, ``start``, ``training`` (extend,
  cache, finetune), ``evaluation`` (evaluate, rerun), ``report`` and ``settings_report`` (the
  "LongCE beyond one setting" plan).
- ``real_models/``: the claims on real pretrained models (Gemma 3 270M, SmolLM2-135M):
  ``cli`` (its stage table), ``members`` (window-limited, context-limited and RoPE-scaled Gemma,
  PI/NTK/YaRN SmolLM2), ``tasks`` (the task documents with the real tokenizers), ``phases`` (the
  resumable device phases), ``analysis`` (its plan's analysis); ``records`` (the earlier studies'
  published tables as records, and their rebuilt report).

Experiments never import each other; a new one is a folder of its own over ``common/``. ``commands``
lists their ``longppl`` subcommands. The first attempt's pipelines (a family of small models trained
from scratch) were removed; docs/reproduction.md says where to read them.
"""
