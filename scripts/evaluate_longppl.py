#!/usr/bin/env python
"""Evaluate models against a key-token cache: the ``longppl-evaluate`` command, whose code is ``longppl.tools.evaluate_models``
(metrics/longppl/tools/evaluate_models.py). ``longppl-evaluate --help`` lists its options.

This wrapper keeps ``python scripts/evaluate_longppl.py ...`` working.
"""

from longppl.tools.evaluate_models import cli

if __name__ == "__main__":
    raise SystemExit(cli())
