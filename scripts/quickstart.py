#!/usr/bin/env python
"""LongPPL in one command: the ``longppl-quickstart`` command, whose code is ``longppl.tools.quickstart``
(metrics/longppl/tools/quickstart.py). ``longppl-quickstart --help`` lists its options.

This wrapper keeps ``python scripts/quickstart.py``, the README's first set-up command, working.
"""

from longppl.tools.quickstart import cli

if __name__ == "__main__":
    raise SystemExit(cli())
