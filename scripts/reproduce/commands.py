"""The reproduction's subcommands of the ``longppl`` command (``longppl reproduce``,
``longppl reproduce-longce``), registered through setup.cfg's ``longppl.commands`` entry-point group:
``{command: ("module:function", one line for --help)}``. Kept free of imports (``longppl --help`` reads it).
"""

COMMANDS = {
    "reproduce": (
        "longppl_reproduce.population:cli",
        "reproduce the paper's LongPPL claim over a population of context extensions",
    ),
    "reproduce-longce": (
        "longppl_reproduce.longce_comparison:cli",
        'reproduce "LongCE beats CE" at small scale, from a base that keeps the task',
    ),
}
