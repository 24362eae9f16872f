"""The LongPPL Space: a thin shell over the installed ``longppl`` package.

The Space's ``requirements.txt`` installs the package; the app itself (the Gradio page, its limits
as a public server) is ``longppl.space.app``.
"""

import os
import sys

# `python app.py` puts this file's folder first on sys.path, and the metric's shell, longppl.py, lies
# beside it (the Space's root holds both): `import longppl` would then find that file instead of the
# installed package. The package is what this app runs, so the folder leaves the path first.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _here]
if "longppl" in sys.modules and not hasattr(sys.modules["longppl"], "__path__"):
    del sys.modules["longppl"]  # the shell file, imported before this ran: not the package

from longppl.space.app import demo  # noqa: E402 (after the path is fixed)

if __name__ == "__main__":
    demo.launch()
