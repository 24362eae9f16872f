#!/usr/bin/env python
"""Reproduce "LongCE beats CE" at small scale, from a base that keeps the task: extend the LongPPL
population's base B by YaRN, fine-tune it with CE, LongCE ("self"), LongCE with E1's cached weights
("cache") and CE for LongCE's wall time ("ce-wallclock") over several seeds, measure lines accuracy
(with curves over the steps), needle, the answer's log-likelihood, PPL, LongPPL and step time, and
write results.json and a report with the paired differences against CE.

    python scripts/reproduce_longce.py --config configs/reproduce/longce_comparison_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro2-longce/ \\
        --base-model repro2/models/B --evaluator repro2/models/E1

The pipeline lives in ``longppl_reproduce.longce_comparison`` (``pipeline``'s docstring describes the stages
and files); ``--help`` lists the flags.
"""

from longppl_reproduce.longce_comparison import cli

if __name__ == "__main__":
    raise SystemExit(cli())
