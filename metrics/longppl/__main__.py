"""``python -m longppl``: the ``longppl`` command (:mod:`longppl.tools.main`)."""

from longppl.tools.main import main

if __name__ == "__main__":
    raise SystemExit(main())
