"""The LongPPL Space: a thin shell over the installed ``longppl`` package.

The Space's ``requirements.txt`` installs the package; the app itself (the Gradio page, its limits
as a public server) is ``longppl.space.app``.
"""

from longppl.space.app import demo

if __name__ == "__main__":
    demo.launch()
