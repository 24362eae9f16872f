#!/usr/bin/env python
"""Reproduce the paper's LongPPL claim at small scale over a population of context extensions of one
base model: lines / needle accuracy, PPL and LongPPL, the planned statistics, results.json and a report.

    python scripts/reproduce_longppl.py --config configs/reproduce/population_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro2/

The pipeline lives in ``longppl_reproduce.population`` (``pipeline``'s docstring describes the stages and files);
``--help`` lists the flags.
"""

from longppl_reproduce.population import cli

if __name__ == "__main__":
    raise SystemExit(cli())
