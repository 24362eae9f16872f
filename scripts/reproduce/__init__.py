"""``longppl_reproduce``: the paper's claims reproduced at small scale, kept outside both libraries.

It imports ``longppl`` (scoring, caches, command helpers) and ``longce`` (the trainer); neither of them
imports it, as torchtune keeps its ``recipes/`` apart from the ``torchtune`` package.

Modules: ``population`` (LongPPL against long-context ability over a population of context
extensions of one base model, ``longppl-reproduce``; its config in ``config``, its output folder in
``run_folder``), ``longce_comparison`` (LongCE against CE from the population's base,
``longppl-reproduce-longce``), ``books`` (reading the corpus), ``family`` (tokenizer, models,
training), ``lines`` (LongEval's "lines" task), ``needle`` (multi-key needle-in-a-haystack),
``two_hop`` (a two-hop lines task), ``third_attempt`` (the third attempt's analysis and report),
``answer_tokens`` (the paper's Figure 5(b): are the answer's tokens key tokens), ``corpus_chunks``
(book chunks and null documents), ``calibration`` (alpha against the null), ``statistics``
(bootstrap intervals, Williams' t, partial correlation, a random-intercept model), ``commands`` (their ``longppl``
subcommands). The first attempt's pipelines (a family of small models trained from scratch) were
removed; docs/reproduction.md says where to read them.
"""
