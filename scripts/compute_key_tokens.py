#!/usr/bin/env python
"""Score a corpus with an evaluator once, into a key-token cache: the ``longppl-score`` command, whose code is ``longppl.tools.compute_key_tokens``
(metrics/longppl/tools/compute_key_tokens.py). ``longppl-score --help`` lists its options.

This wrapper keeps ``python scripts/compute_key_tokens.py ...`` and ``accelerate launch ... scripts/compute_key_tokens.py ...`` working.
"""

from longppl.tools.compute_key_tokens import cli

if __name__ == "__main__":
    raise SystemExit(cli())
