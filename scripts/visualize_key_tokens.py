#!/usr/bin/env python
"""A key-token cache as an HTML page and an LSD histogram: the ``longppl-visualize`` command, whose code is ``longppl.tools.visualize_key_tokens``
(metrics/longppl/tools/visualize_key_tokens.py). ``longppl-visualize --help`` lists its options.

This wrapper keeps ``python scripts/visualize_key_tokens.py ...`` working.
"""

from longppl.tools.visualize_key_tokens import cli

if __name__ == "__main__":
    raise SystemExit(cli())
