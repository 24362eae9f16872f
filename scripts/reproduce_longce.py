#!/usr/bin/env python
"""Reproduce "LongCE beats CE" at small scale: extend a short-context model's context, fine-tune it
with CE, LongCE ("self") and LongCE with an evaluator's cached weights ("cache") over several seeds,
measure lines accuracy, PPL, LongPPL and step time, and write results.json and a report.

    python scripts/reproduce_longce.py --config configs/reproduce/longce_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro-longce/

The pipeline lives in ``longppl_reproduce.longce_run`` (its docstring describes the stages and
files); ``--help`` lists the flags.
"""

from longppl_reproduce.longce_run import cli

if __name__ == "__main__":
    raise SystemExit(cli())
