"""How many CPU threads torch uses: one policy for the scripts, chosen deliberately.

torch starts one intra-op thread per core. For the tiny models of the quickstart, the smoke runs
and the tests, each operation is too small to split: the extra threads only wait for each other,
and on a loaded machine they wait for cores too (the quickstart took 994 s with torch's default
under load, 109 s with one thread). A user who sets ``OMP_NUM_THREADS`` has chosen: that wins.

Import-light (torch is imported only when the count is applied), so the scripts can use it before
anything heavy is loaded.
"""

from __future__ import annotations

import os

#: The variable a user sets to choose the thread count (torch reads it at start-up too).
THREADS_VARIABLE = "OMP_NUM_THREADS"


def requested_threads(environ: dict[str, str] | None = None) -> int | None:
    """The thread count the user asked for with ``OMP_NUM_THREADS``, or ``None`` when it is unset or empty.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is set but is not a positive integer; the message says what to set.
    """
    value = (os.environ if environ is None else environ).get(THREADS_VARIABLE, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{THREADS_VARIABLE}={value!r} is not a positive integer. Set it to the number of CPU threads "
            f"torch may use (e.g. {THREADS_VARIABLE}=1), or unset it to let the script choose."
        )
    return int(value)


def choose_torch_threads(threads: int = 1) -> int:
    """Set torch's intra-op CPU threads to ``threads``, unless the user set ``OMP_NUM_THREADS``.

    Args:
        threads: the count for this workload when the user chose none: 1 for tiny models (the
            quickstart's toy model, ``--tiny`` smoke runs), whose operations are too small to share.

    Returns:
        The intra-op thread count torch now uses: ``OMP_NUM_THREADS`` when set, else ``threads``.

    Raises:
        ValueError: ``threads`` < 1, or ``OMP_NUM_THREADS`` is not a positive integer.
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}.")
    import torch

    chosen = requested_threads()
    chosen = threads if chosen is None else chosen
    if torch.get_num_threads() != chosen:
        torch.set_num_threads(chosen)
    return chosen


def child_thread_env(environ: dict[str, str], threads: int = 1) -> dict[str, str]:
    """A copy of ``environ`` for a child process with ``OMP_NUM_THREADS=threads``, unless set (non-empty) already."""
    env = dict(environ)
    if requested_threads(env) is None:
        env[THREADS_VARIABLE] = str(threads)
    return env
