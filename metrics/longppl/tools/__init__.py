"""What only the command-line tools need: corpus readers, tables and reports, correlation and figures,
the key-token HTML view, the cache-selection flags, thread choice, and the quickstart's toy task.

Nothing in the metric (``longppl.py``), its scoring core or the Space imports this package, so the Space
upload leaves it out (``scripts/push_metric_to_hub.py``) and ``evaluate`` never copies it.
"""
