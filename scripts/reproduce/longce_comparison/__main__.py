"""``python -m longppl_reproduce.longce_comparison``: the ``longppl-reproduce-longce`` command."""

from .pipeline import cli

if __name__ == "__main__":
    raise SystemExit(cli())
