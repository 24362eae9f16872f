#!/usr/bin/env python
"""Reproduce the paper's LongPPL claims at small scale: train a family of small LMs, measure lines
accuracy, PPL and LongPPL, correlate them, and write results.json and a report.

    python scripts/reproduce_longppl.py --config configs/reproduce/family_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro/

The pipeline lives in ``longppl_reproduce.longppl_run`` (its docstring describes the stages and files);
``--help`` lists the flags.
"""

from longppl_reproduce.longppl_run import cli

if __name__ == "__main__":
    raise SystemExit(cli())
