"""What the commands share, below them: how a command runs, what it reads and what it writes.

``running`` (how a tool runs as a command: ``ToolParser``, ``run_command``, one-line errors, YAML
configs), ``interrupts`` (Ctrl-C: one line and status 130; ``import longppl`` uses it too, through
``longppl.register``), ``threads`` (torch's CPU threads), ``corpus`` (corpus readers),
``cache_options`` (the cache-selection flags), ``reports``, ``correlation``, ``figures``, and
``synthetic`` (the quickstart's toy task with a known answer).

The commands (``longppl.tools``), the harness, the ``longce-train`` command and the reproduction import
these modules; nothing here imports a command. Empty on purpose: ``import longppl`` imports
``interrupts`` through this package, and a command's ``--help`` answers before torch.
"""
