"""Ctrl-C in a command: one ``<prog>: interrupted`` line and status 130 (:data:`INTERRUPTED_STATUS`)
instead of a traceback, also when the ``KeyboardInterrupt`` lands in a finalizer or while ``import
longppl`` registers the metric (:mod:`longppl.register`, which runs before any command's code).

Standard library only, and light at import: ``import longppl`` imports this module
(:func:`longppl.register.ensure_registered` uses it), and a command's ``--help`` answers before torch.
:func:`longppl.commandline.running.interruptible` is the commands' ``with`` block around it.
"""

from __future__ import annotations

import atexit
import os
import sys

#: The exit status of a command ended by Ctrl-C (SIGINT): 128 + the signal's number, as shells report it.
INTERRUPTED_STATUS = 130

# The status end_interrupted gave, once it has run (None before).
_ending_status: int | None = None


def _keep_the_interrupted_status() -> None:
    """``atexit`` handler: after a command ended by :func:`end_interrupted`, leave the process with
    its status before the interpreter's last check can replace it.

    CPython remembers a ``KeyboardInterrupt`` that escaped code run through ``PyRun_String`` (which
    C extensions use while they import: a Ctrl-C during ``import torch`` can land there), even when
    the program caught it later; under ``python -m`` it then ends the process by SIGINT itself (status
    -2) after the interpreter has shut down, whatever ``sys.exit`` asked for. Registered when this
    module is imported (``import longppl``, before any command's code), so it runs after every other
    ``atexit`` handler (they run last registered first); it does nothing unless a command was
    interrupted."""
    if _ending_status is None:
        return
    if "logging" in sys.modules:  # its own atexit handler, registered earlier, would run after this one
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams: nothing to flush
            pass
    os._exit(_ending_status)


atexit.register(_keep_the_interrupted_status)


def is_project_command() -> tuple[bool, str]:
    """``(whether this process is one of the project's commands, its name)``: a console script of the
    ``longppl``, ``longce`` or ``longppl_reproduce`` packages, or ``python -m ...`` (whose module is
    still being found while ``import longppl`` runs)."""
    from importlib.metadata import entry_points

    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "longppl"
    ours = ("longppl.", "longppl_reproduce.", "longce.")
    scripts = {point.name for point in entry_points(group="console_scripts") if point.value.startswith(ours)}
    return sys.argv[:1] == ["-m"] or name in scripts, name


def _redeliver_interrupt(unraisable, previous=None) -> None:
    """``sys.unraisablehook`` of a command: a Ctrl-C whose ``KeyboardInterrupt`` was raised inside a
    finalizer (a ``__del__``, say during garbage collection while a library imports) is only
    printed by Python ("Exception ignored in ...") and lost, and the command would run on. It is sent
    again from a short-lived thread, so that it reaches the main thread after the finalizer, as the
    Ctrl-C the user gave; any other unraisable exception goes to ``previous`` (Python's hook)."""
    import signal
    import threading

    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        main = threading.main_thread().ident
        # to the main thread itself where the platform can (a blocking call there, a sleep, returns at once)
        again = (
            (lambda: signal.pthread_kill(main, signal.SIGINT))
            if hasattr(signal, "pthread_kill")
            else (lambda: signal.raise_signal(signal.SIGINT))
        )
        # a daemon: a command that ends meanwhile does not wait for it (end_interrupted ignores the signal)
        timer = threading.Timer(0.01, again)
        timer.daemon = True
        timer.start()
        return
    (previous or sys.__unraisablehook__)(unraisable)


def keep_interrupts_from_finalizers() -> None:
    """Install :func:`_redeliver_interrupt` as ``sys.unraisablehook`` (once; the hook it replaces
    handles every other unraisable exception). Run by the commands
    (:func:`longppl.commandline.running.interruptible`, and :func:`longppl.register.ensure_registered` in
    a command), never by ``import longppl`` in a program."""
    import functools

    if getattr(sys.unraisablehook, "func", None) is _redeliver_interrupt:
        return
    sys.unraisablehook = functools.partial(_redeliver_interrupt, previous=sys.unraisablehook)


def exit_if_command_interrupted() -> None:
    """For a Ctrl-C that arrives while ``import longppl`` registers the metric
    (:func:`longppl.register.ensure_registered`), which runs before any command's ``interruptible``: when
    this process is one of the project's commands (a console script of the ``longppl``, ``longce`` or ``longppl_reproduce``
    packages, or ``python -m ...``, whose module is still being found), end it with one line and
    :data:`INTERRUPTED_STATUS`, as ``interruptible`` does; otherwise (``import longppl`` in a program,
    or ``LONGPPL_DEBUG`` set) return, and the ``KeyboardInterrupt`` goes on. Standard library only: it
    runs inside ``import longppl``, before any command's code."""
    command, name = is_project_command()
    debugging = os.environ.get("LONGPPL_DEBUG", "").strip().lower() in ("1", "on", "yes", "true")
    if command and not debugging:
        end_interrupted(name if name != "-m" else "longppl")


def end_interrupted(prog: str) -> None:
    """End a command that Ctrl-C interrupted: one ``<prog>: interrupted`` line on stderr and
    :data:`INTERRUPTED_STATUS`. SIGINT is ignored from here on: Python gives SIGINT back its default
    action (death by the signal, status -2) while it shuts down, and a second Ctrl-C, or one that
    :func:`_redeliver_interrupt` sends again a moment late, would otherwise replace the status; the
    interpreter's own late SIGINT is kept off by :func:`_keep_the_interrupted_status`."""
    import signal

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signal handlers can only be set there
        pass
    global _ending_status
    _ending_status = INTERRUPTED_STATUS  # see _keep_the_interrupted_status
    print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    sys.exit(INTERRUPTED_STATUS)
