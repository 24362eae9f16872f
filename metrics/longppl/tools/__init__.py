"""The command-line tools, and nothing else: each module is a command.

``main`` (``longppl``), ``compute_key_tokens`` (``longppl-score``), ``evaluate_models``
(``longppl-evaluate``), ``visualize_key_tokens`` (``longppl-visualize``), ``cache_tool``
(``longppl-cache``), ``quickstart`` (``longppl-quickstart``), and ``score_pipeline`` (``longppl score``
as a datatrove pipeline step). What they share (parsers, errors, Ctrl-C, corpus readers, reports,
figures) is ``longppl.commandline``, a floor below; the benchmarks' shared code is scripts/bench/common.py,
outside the package.

Nothing in the metric (``longppl.py``), its scoring core or the Space imports this package, so the Space
upload leaves it out (``scripts/push_metric_to_hub.py``) and ``evaluate`` never copies it.
"""
