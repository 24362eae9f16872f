"""``python -m longppl_reproduce.population``: the ``longppl-reproduce`` command."""

from .pipeline import cli

if __name__ == "__main__":
    raise SystemExit(cli())
