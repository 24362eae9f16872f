"""``longce``'s subcommand of the ``longppl`` command (``longppl train``), registered through setup.cfg's
``longppl.commands`` entry-point group: ``{command: ("module:function", one line for --help)}``.

Kept free of imports so that ``longppl --help`` reads it without loading transformers' Trainer.
"""

COMMANDS = {
    "train": ("longce.cli:main", "fine-tune a causal LM with LongCE from a YAML recipe"),
}
