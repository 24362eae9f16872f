#!/usr/bin/env python
"""Fine-tune a causal LM with LongCE from a YAML recipe: the ``longce-train`` command, run from a checkout.

    python scripts/train_longce.py --config configs/tiny_cpu.yaml               # CPU, seconds
    python scripts/train_longce.py --config configs/tiny_cpu.yaml --learning_rate 1e-4 --max_steps 10
    accelerate launch --config_file <accelerate.yaml> scripts/train_longce.py \\
        --config configs/setting_a_pg19_eabf.yaml                               # the paper's setting A

Same flags, recipes and output as ``longce-train`` (``longce.cli``); ``--help`` lists the recipe fields,
``--help-all`` every ``TrainingArguments`` field. The parser lives in ``longce.arguments``, the fields in
``longce.script_arguments``, the data pipeline in ``longce.data``.
"""

import sys

try:
    from longce.cli import main
except ImportError:  # a checkout without `pip install`
    sys.exit("install the project first: pip install -e .")

if __name__ == "__main__":
    sys.exit(main())
