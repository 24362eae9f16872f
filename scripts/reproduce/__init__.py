"""``longppl_reproduce``: the paper's claims reproduced at small scale, kept outside both libraries.

It imports ``longppl`` (scoring, caches, command helpers) and ``longce`` (the trainer); neither of them
imports it, as torchtune keeps its ``recipes/`` apart from the ``torchtune`` package.

Modules: ``longppl_run`` (LongPPL against long-context ability over a family of small LMs,
``longppl-reproduce``), ``longce_comparison`` (LongCE against CE from the population's base,
``longppl-reproduce-longce``; ``longce_run``, the first attempt's), ``family``
(tokenizer, models, training), ``lines`` (LongEval's "lines" task), ``answer_tokens`` (the paper's
Figure 5(b): are the answer's tokens key tokens), ``commands`` (their ``longppl`` subcommands).
"""
