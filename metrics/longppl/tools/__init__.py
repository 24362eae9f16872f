"""The command-line tools and the helpers only they use; nothing else lives here.

Commands: ``main`` (``longppl``), ``compute_key_tokens`` (``longppl-score``), ``evaluate_models``
(``longppl-evaluate``), ``visualize_key_tokens`` (``longppl-visualize``), ``quickstart``
(``longppl-quickstart``). Their helpers: ``cli`` (how a tool runs as a command), ``cache_cli`` (the
cache-selection flags), ``corpus`` (corpus readers), ``reports``, ``correlation``, ``figures``,
``threads``, ``synthetic`` (the quickstart's toy task), ``benchmarking`` (what the benchmark scripts of
scripts/ share).

Nothing in the metric (``longppl.py``), its scoring core or the Space imports this package, so the Space
upload leaves it out (``scripts/push_metric_to_hub.py``) and ``evaluate`` never copies it.
"""
