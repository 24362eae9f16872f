"""The ``longce-chain`` stage of "LongCE from a real start" (docs/reproduction.md): the units of
``longce-train`` and ``longce-evaluate`` (module ``longce_start``) in one pipeline a device, shared by
the processes side by side on it through claims (``claims``), and the time estimates, read from the
units measured before, by which it begins no unit that would not end within the time left.

- :func:`chain`: one training a device at a time, the checkpoints it saves evaluated beside it by the
  other processes, so that a session's end loses no trained unit but the one in hand.
- :func:`unit_seconds`, :func:`evaluation_seconds`: what a unit and one checkpoint's evaluation still
  need on this machine, from the records (``longce_start.measured``).
- :func:`device_name`: the physical device a process's ``cuda:<k>`` is, as the claims name it.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np

from . import phases
from .claims import claim, held
from .longce_start import (
    WEIGHTS_OF_ARM,
    Choice,
    LongCESizes,
    Start,
    evaluate_model,
    evaluation_units,
    fresh_steps,
    measured,
    pilot_ratio,
    train_unit,
    trained_here,
    trained_keys,
    training_units,
    unit_key,
    weights_path,
)
from .phases import Run
from .progress import Budget, pending, say_once

# ------------------------------------------------------------------ estimates from the records


#: the trainings of a start that estimate its next ones: its last, which ran as units run now
RECENT_TRAININGS = 3

#: the trainings of a start among which an arm's own runs, where there are any, estimate its next one:
#: about two sessions' trainings of an S1 start, all run one training a device
RECENT_ARM_TRAININGS = 10


def evaluation_seconds(run: Run, start: Start, rows: dict | None = None) -> float | None:
    """About how many seconds one checkpoint's evaluation of ``start`` takes: the median seconds of
    its evaluated checkpoints in the records (every session's, any arm; the start's own evaluation
    pays one-off costs and is left out). None when none is measured yet. ``rows``: the records
    already read (``longce_start.measured``), else they are read here."""
    rows = (rows or measured(run))["longce_evaluate"]
    found = [r["seconds"] for r in rows if r.get("start") == start.name and r.get("step")]  # step 0: the start
    return float(np.median(found)) if found else None


def unit_seconds(
    run: Run, sizes: LongCESizes, start: Start, arm: str, seed: int, helped: bool = False, rows: dict | None = None
) -> float | None:
    """About how many seconds the unit ``start/arm-s<seed>`` still needs on this machine, read from the
    units measured before it (the records, every session's): its training, unless
    :func:`trained_here`, plus one evaluation (:func:`evaluation_seconds`) for each checkpoint not yet
    evaluated. ``helped``: other processes on the device evaluate the checkpoints a training saves
    before its end while it goes on (:func:`chain`), so a unit to train counts only its last
    checkpoint's evaluation after the training.

    A training takes the median of ``arm``'s own runs among the start's last
    :data:`RECENT_ARM_TRAININGS` recorded runs (runs that resumed are left out: their seconds are a
    part). With none, the median of the start's last :data:`RECENT_TRAININGS` runs, any arm's, each
    brought to ``arm``'s cost by the start's pilot: a ``self`` step costs r ``ce`` steps, ``ce-fresh``
    runs r times the steps, ``frozen`` and ``shuffled`` cost what ``ce`` does. The last runs, not
    all: how units share a GPU changed across sessions (four trainings side by side at first, one a
    device since), and the last ones ran as the next will. The arm's own runs first: the pilot timed
    steps alone, while a unit's training shares the GPU with its checkpoints' evaluations for part
    of its time, a smaller part of a longer run (S1 ``ce-fresh`` took 290-334 s where its pilot
    scaling gave about 440). Without the start's pilot record and no own run, the median of
    ``arm``'s runs, or with none its slowest arm's. Plus the start's weights scoring (its ``longce_weights`` record)
    for a ``frozen`` or ``shuffled`` unit on a machine without them. None when nothing of the start
    is measured yet (nothing to go on). ``rows``: the records already read
    (``longce_start.measured``), else they are read here."""
    rows = rows or measured(run)
    train_rows, evaluate_rows = rows["longce_train"], rows["longce_evaluate"]
    trains = [r for r in train_rows if r.get("start") == start.name and not r.get("resumed")]
    recorded, evaluated = {r["key"] for r in train_rows}, {r["key"] for r in evaluate_rows}
    key = unit_key(start, arm, seed)
    left = [c for c in sizes.checkpoints if f"{key}/{c}" not in evaluated]
    seconds = 0.0
    if not trained_here(run, sizes, start, arm, seed, recorded, evaluated):
        if not trains:
            return None
        own = [r["seconds"] for r in trains[-RECENT_ARM_TRAININGS:] if r["arm"] == arm]
        if own:
            seconds += float(np.median(own))
        elif (ratio := pilot_ratio(rows.get("longce_start", []), start)) is not None:
            cost = {"self": ratio, "ce-fresh": fresh_steps(sizes, ratio) / sizes.steps}
            recent = [r["seconds"] / cost.get(r["arm"], 1.0) for r in trains[-RECENT_TRAININGS:]]
            seconds += float(np.median(recent)) * cost.get(arm, 1.0)
        else:
            medians = {
                a: float(np.median([r["seconds"] for r in trains if r["arm"] == a])) for a in {r["arm"] for r in trains}
            }
            seconds += medians.get(arm, max(medians.values()))
        if WEIGHTS_OF_ARM[arm] == "cache" and not os.path.isfile(weights_path(run, start)):
            scored = [r for r in rows["longce_weights"] if r.get("key") == start.name]
            seconds += scored[0]["scoring_seconds"] if scored else 0.0
        if helped:
            left = left[-1:]
    if left:
        evaluation = evaluation_seconds(run, start, rows)
        if evaluation is None:
            return None
        seconds += len(left) * evaluation
    return seconds


# ------------------------------------------------------------------ the chain


#: seconds a ``longce-chain`` process waits before it looks again while another process trains on
#: its device (whose checkpoints it evaluates as they are saved)
WAIT_SECONDS = 10.0


#: waits (of ``WAIT_SECONDS``) a ``longce-chain`` process makes, at most, for the processes started
#: beside it (``Choice.workers``) to join before it chooses a unit to train: they start one after
#: another (each runs ``longce-start`` first), and a choice made before they join counts no helper
PEER_WAITS = 12


def _wait() -> None:
    time.sleep(WAIT_SECONDS)


def device_name(device: str) -> str:
    """The physical device behind ``device`` (``"cuda:<k>"``, ``"cpu"``), as claims name it: ``cuda:<k>``
    is the k-th GPU that ``CUDA_VISIBLE_DEVICES`` leaves visible, so two processes each shown one other
    GPU (both ``cuda:0`` to torch) are on different devices. ``device`` itself where nothing maps it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    match = re.fullmatch(r"cuda:(\d+)", device)
    if match is None or not visible:
        return device
    shown = [part.strip() for part in visible.split(",") if part.strip()]
    index = int(match.group(1))
    return f"cuda:{shown[index]}" if index < len(shown) else device


def _chain_phase(run: Run) -> str:
    """The claims' phase of the chain processes on the run's device (one claim each, by process id)."""
    return "longce-chain/" + re.sub(r"[^\w.-]", "~", device_name(run.device))


def chain(run: Run, choice: Choice) -> None:
    """``longce-train``'s and ``longce-evaluate``'s units in one process, so that each unit is
    evaluated on the machine that trained it. Processes side by side on a device share the work:

    - an evaluation comes first: any model saved on this machine and not evaluated yet (the starts'
      own, then the checkpoints in the units' order), including the checkpoints that a training still
      going on has saved;
    - else one process at a time on a device trains the next unit in ``longce-train``'s order (seeds
      outermost), its checkpoints then evaluated by the processes that are free, itself included;
    - else, while a training goes on in the run folder, the process waits (``WAIT_SECONDS``) for its
      checkpoints; with none, it ends.

    Before its first choice of a unit to train, a process waits (up to ``PEER_WAITS`` waits) for the
    ``choice.workers`` processes started on its device to join (each holds a claim while it runs), so
    that the choice counts them as helpers; its evaluations go on meanwhile.

    The GPU's throughput is shared by what runs on it, so several trainings side by side each take
    as many times longer: a unit then outlasts a session (four 32k trainings took 2.0 s a step each,
    and an ``s1`` unit with its three evaluations about 1,800 s of a session's 1,450), and a unit cut
    off at the session's end is lost with its machine. One training a device, with its first
    checkpoints evaluated beside it, ends each unit soonest for the same throughput.

    No unit or evaluation is begun after ``budget_seconds``, nor one that would not end within them
    by the units measured before (:func:`unit_seconds`, :func:`evaluation_seconds`; with other
    processes on the device, a unit to train counts only its last checkpoint's evaluation after it).
    A ``frozen`` or ``shuffled`` unit scores its start's weights first where this machine lacks them.
    The starts must be built on this machine (``longce-start``).

    Raises:
        ValueError: the run's records hold no calibration of the Gemma evaluator (the evaluations
            read its alpha), before any unit is trained."""
    phases.alphas(run)
    budget, said, peer_waits = Budget(run.budget_seconds), set(), PEER_WAITS
    wanted = choice.workers  # the processes waited for; 0 once the first choice is made
    workers = _chain_phase(run)

    def joined(here: int) -> str:
        return (
            f"longce-chain: {here} of the {choice.workers} processes started on {device_name(run.device)} have joined"
        )

    with claim(run.root, workers, str(os.getpid())):
        while not budget.spent():
            if _evaluate_next(run, choice, budget, said):
                continue
            here = len(held(run.root, workers))
            if here < wanted and peer_waits > 0:
                peer_waits -= 1
                say_once(run, said, f"{joined(here)}; waiting for the others before choosing a unit to train")
                _wait()
                continue
            if here < wanted:
                say_once(run, said, f"{joined(here)} after {PEER_WAITS * WAIT_SECONDS:.0f} s; going on with them")
            wanted = 0  # once only: later a process that ends its pass leaves the others to go on without it
            trained = _train_next(run, choice, budget, said, helped=here > 1)
            if trained == "trained":
                continue
            if trained == "none" and not held(run.root, "longce-device"):
                return  # nothing to train here and no training whose checkpoints would come
            _wait()
        run.log("longce-chain: budget spent; call again")


def _passed_over(run: Run, said: set, what: str, needed: float, budget: Budget) -> None:
    line = f"longce-chain: {what} needs about {needed:.0f} s by the units measured so far"
    say_once(run, said, line, f", {budget.left():.0f} s are left; passed over")


def _evaluate_next(run: Run, choice: Choice, budget: Budget, said: set) -> bool:
    """Make the first evaluation of a model saved here that no process has made or holds and that
    fits the budget; whether one was made."""
    records = run.records("longce_evaluate")
    rows = {"longce_evaluate": records.rows()}
    done = {r["key"] for r in rows["longce_evaluate"]}
    estimates = {start.name: evaluation_seconds(run, start, rows) for start in choice.starts}
    fitting = []
    for key, unit in evaluation_units(run, choice, here_only=True):
        if key in done:
            continue
        needed = estimates[unit[0].name] if unit[4] else None  # a start's own: always made
        if needed is not None and needed > budget.left():
            _passed_over(run, said, key, needed, budget)
            continue
        fitting.append((key, unit))
    for key, unit in pending(run, "longce-evaluate", records, budget, fitting, said=said):
        evaluate_model(run, choice.sizes, records, key, *unit)
        return True
    return False


def _train_next(run: Run, choice: Choice, budget: Budget, said: set, helped: bool) -> str:
    """Train the first unit of ``choice`` that needs training here, no process holds and fits the
    budget, if no other process trains on this device: ``"trained"``, ``"busy"`` (another process
    trains on it) or ``"none"`` (no unit to train)."""
    with claim(run.root, "longce-device", device_name(run.device)) as holder:  # one training a device
        if holder is not None:
            return "busy"
        records = run.records("longce_train")
        units = training_units(choice)
        rows = measured(run)
        done = trained_keys(run, choice, units, rows)
        fitting = []
        for key, (start, arm, seed) in units:
            if key in done:
                continue
            needed = unit_seconds(run, choice.sizes, start, arm, seed, helped=helped, rows=rows)
            if needed is not None and needed > budget.left():
                _passed_over(run, said, key, needed, budget)
                continue
            fitting.append((key, (start, arm, seed)))

        def still() -> set[str]:
            return trained_keys(run, choice, fitting)

        for key, unit in pending(run, "longce-train", records, budget, fitting, done=still, said=said):
            train_unit(run, choice, records, key, *unit)
            return "trained"
    return "none"
