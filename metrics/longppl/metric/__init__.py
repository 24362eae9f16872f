"""The ``evaluate`` metric's logic: its arguments, declared once (``options``), what ``compute``
runs (``compute``), and the drop-in for the official ``longppl`` package (``official``). The
metric file ``longppl.py`` beside this package is a thin shell over ``compute``."""
