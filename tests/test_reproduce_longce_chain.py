"""The ``longce-chain`` stage of the LongCE study from a real start, on records alone (no models: a
unit's training and evaluation stand-ins write records and folders): the time estimates read from the
units measured before, the one training a device and the evaluations beside it, the wait for the
processes started beside it, and the devices named by the GPU that ``CUDA_VISIBLE_DEVICES`` shows."""

import contextlib
import dataclasses
import json
import os
import shutil

import pytest


def _measured_run(tmp_path, budget_seconds):
    """A run folder whose records say how long units took before (no models: only the records)."""
    from longppl_reproduce.real_models import longce_start, phases

    run = phases.Run(str(tmp_path), "", "", "", "cpu", budget_seconds, None, phases.PLAN)
    records = tmp_path / "records"
    records.mkdir(parents=True)

    def write(name, rows):
        (records / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    train = [
        {"key": "s1/ce-s0", "start": "s1", "arm": "ce", "seconds": 100.0, "resumed": False},
        {"key": "s1/ce-s1", "start": "s1", "arm": "ce", "seconds": 140.0, "resumed": False},
        {"key": "s1/ce-s2", "start": "s1", "arm": "ce", "seconds": 10.0, "resumed": True},  # a part: left out
        {"key": "s1/self-s0", "start": "s1", "arm": "self", "seconds": 300.0, "resumed": False},
        {"key": "s2/ce-s0", "start": "s2", "arm": "ce", "seconds": 30.0, "resumed": False},
    ]
    evaluations = [
        {"key": "s1/start", "start": "s1", "arm": "start", "step": 0, "seconds": 999.0},  # not a checkpoint
        {"key": "s1/ce-s0/50", "start": "s1", "arm": "ce", "step": 50, "seconds": 200.0},
        {"key": "s1/ce-s0/100", "start": "s1", "arm": "ce", "step": 100, "seconds": 210.0},
        {"key": "s1/ce-s0/200", "start": "s1", "arm": "ce", "step": 200, "seconds": 260.0},
        {"key": "s2/ce-s0/50", "start": "s2", "arm": "ce", "step": 50, "seconds": 60.0},
    ]
    write("longce_train", train)
    write("longce_evaluate", evaluations)
    write("longce_weights", [{"key": "s1", "scoring_seconds": 50.0}])
    starts = {s.name: s for s in longce_start.PLAN.starts}
    return run, starts


def test_a_units_seconds_are_read_from_the_units_measured_before(tmp_path):
    from longppl_reproduce.real_models.longce_chain import unit_seconds
    from longppl_reproduce.real_models.longce_start import PLAN, unit_folder

    run, starts = _measured_run(tmp_path, 1000.0)
    s1, s2 = starts["s1"], starts["s2"]
    evaluation = 210.0  # median of the s1 checkpoints' 200, 210, 260 (the start's own row is no checkpoint)
    ce = (100.0 + 140.0) / 2  # the resumed run's 10 s are a part of a run
    assert unit_seconds(run, PLAN, s1, "ce", 3) == pytest.approx(ce + 3 * evaluation)
    assert unit_seconds(run, PLAN, s1, "self", 1) == pytest.approx(300.0 + 3 * evaluation)
    # other processes on the device evaluate the checkpoints saved before the training's end
    assert unit_seconds(run, PLAN, s1, "self", 1, helped=True) == pytest.approx(300.0 + evaluation)
    # no frozen run measured: the slowest arm, plus the weights' scoring (no weights on this machine)
    assert unit_seconds(run, PLAN, s1, "frozen", 0) == pytest.approx(300.0 + 50.0 + 3 * evaluation)
    assert unit_seconds(run, PLAN, s1, "ce", 0) == 0.0  # trained and every checkpoint evaluated
    # trained, nothing evaluated, no checkpoint here: trained again; with them here, only evaluated
    assert unit_seconds(run, PLAN, s1, "ce", 1) == pytest.approx(ce + 3 * evaluation)
    for step in PLAN.checkpoints:
        (tmp_path / "point").mkdir(exist_ok=True)
        shutil.copytree(tmp_path / "point", f"{unit_folder(run, s1, 'ce', 1)}/point-{step}")
    assert unit_seconds(run, PLAN, s1, "ce", 1) == pytest.approx(3 * evaluation)
    assert unit_seconds(run, PLAN, s2, "ce", 1) == pytest.approx(30.0 + 3 * 60.0)
    (tmp_path / "records" / "longce_evaluate.jsonl").write_text("")
    assert unit_seconds(run, PLAN, s1, "ce", 3) is None  # no evaluation measured: nothing to go on


def _with_pilot_and_later_runs(tmp_path):
    """The fixture's run, with s1's and s2's pilots and later s1 runs, as units run now."""
    run, starts = _measured_run(tmp_path, 1000.0)
    # s1's pilot: a self step costs 1.5 ce steps; ce-fresh runs round(1.5 x 200) steps at a ce step's cost
    (tmp_path / "records" / "longce_start.jsonl").write_text(
        json.dumps({"key": "pilot/s1", "start": "s1", "r": 1.5})
        + "\n"
        + json.dumps({"key": "pilot/s2", "r": 2.0})
        + "\n"
    )
    later = [  # after the fixture's runs (ce 100, ce 140, a resumed part, self 300)
        {"key": "s1/frozen-s1", "start": "s1", "arm": "frozen", "seconds": 80.0, "resumed": False},
        {"key": "s1/self-s1", "start": "s1", "arm": "self", "seconds": 90.0, "resumed": False},  # 60 ce-seconds
        {"key": "s1/ce-fresh-s1", "start": "s1", "arm": "ce-fresh", "seconds": 120.0, "resumed": False},  # 80
        {"key": "s1/ce-s3", "start": "s1", "arm": "ce", "seconds": 5.0, "resumed": True},  # a part: left out
    ]
    with open(tmp_path / "records" / "longce_train.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in later)
    return run, starts


def test_a_trainings_seconds_are_its_arms_recent_runs_else_the_starts_last_runs_by_its_pilot(tmp_path):
    from longppl_reproduce.real_models.longce_chain import RECENT_ARM_TRAININGS, RECENT_TRAININGS, unit_seconds
    from longppl_reproduce.real_models.longce_start import PLAN, fresh_steps

    run, starts = _with_pilot_and_later_runs(tmp_path)
    s1 = starts["s1"]
    evaluation = 210.0  # as in the fixture
    assert (RECENT_TRAININGS, RECENT_ARM_TRAININGS) == (3, 10)  # every s1 run is among its last 10
    # an arm with runs of its own: their median, not the pilot's scaling of the others
    assert unit_seconds(run, PLAN, s1, "ce", 3) == pytest.approx((100.0 + 140.0) / 2 + 3 * evaluation)
    assert unit_seconds(run, PLAN, s1, "self", 2) == pytest.approx((300.0 + 90.0) / 2 + 3 * evaluation)
    assert unit_seconds(run, PLAN, s1, "ce-fresh", 2, helped=True) == pytest.approx(120.0 + evaluation)
    # shuffled has none: the last three runs brought to a ce training's cost by the pilot (80, 60 and
    # 120 / (300 / 200) = 80: median 80), plus the weights' scoring on a machine without them
    assert fresh_steps(PLAN, 1.5) == 300
    assert unit_seconds(run, PLAN, s1, "shuffled", 2) == pytest.approx(80.0 + 50.0 + 3 * evaluation)
    # s2's only run is ce: 30 s a ce training, its self twice that (its own pilot, not s1's)
    assert unit_seconds(run, PLAN, starts["s2"], "self", 1, helped=True) == pytest.approx(2 * 30.0 + 60.0)


def test_an_arms_own_runs_count_only_among_the_starts_recent_ones(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain
    from longppl_reproduce.real_models.longce_start import PLAN

    run, starts = _with_pilot_and_later_runs(tmp_path)
    s1 = starts["s1"]
    evaluation = 210.0
    # the last four s1 runs that did not resume: self 300, frozen 80, self 90, ce-fresh 120
    monkeypatch.setattr(longce_chain, "RECENT_ARM_TRAININGS", 4)
    # ce's runs (100, 140) are older: the last three by the pilot instead (80, 60, 80: median 80)
    assert longce_chain.unit_seconds(run, PLAN, s1, "ce", 3) == pytest.approx(80.0 + 3 * evaluation)
    assert longce_chain.unit_seconds(run, PLAN, s1, "self", 2) == pytest.approx((300.0 + 90.0) / 2 + 3 * evaluation)
    monkeypatch.setattr(longce_chain, "RECENT_ARM_TRAININGS", 2)  # self 90 and ce-fresh 120 only
    assert longce_chain.unit_seconds(run, PLAN, s1, "self", 2) == pytest.approx(90.0 + 3 * evaluation)
    assert longce_chain.unit_seconds(run, PLAN, s1, "frozen", 2) == pytest.approx(80.0 + 50.0 + 3 * evaluation)


def _mocked_chain(tmp_path, monkeypatch, budget_seconds):
    """A measured run (no models) whose chain trains and evaluates by writing records alone: a unit's
    training saves its checkpoints' folders. Returns ``(run, choice, done)``, ``done`` the
    ``(stage, key)`` pairs in the order they ran."""
    from longppl_reproduce.real_models import longce_chain, longce_start, phases

    done = []
    seconds = {("s1", "train"): 120.0, ("s2", "train"): 30.0, ("s1", "evaluate"): 210.0, ("s2", "evaluate"): 60.0}

    def train_unit(run, choice, records, key, start, arm, seed):
        done.append(("train", key))
        for c in choice.sizes.checkpoints:
            os.makedirs(f"{longce_start.unit_folder(run, start, arm, seed)}/point-{c}", exist_ok=True)
        row = {"start": start.name, "arm": arm, "seed": seed, "seconds": seconds[start.name, "train"]}
        records.append(key, {**row, "resumed": False})  # the medians stay as they were

    def evaluate_model(run, sizes, records, key, start, folder, arm, seed, step):
        done.append(("evaluate", key))
        records.append(key, {"start": start.name, "step": step, "seconds": seconds[start.name, "evaluate"]})

    monkeypatch.setattr(phases, "alphas", lambda run: {"gemma": 6.0})
    monkeypatch.setattr(longce_chain, "train_unit", train_unit)
    monkeypatch.setattr(longce_chain, "evaluate_model", evaluate_model)
    run, starts = _measured_run(tmp_path, budget_seconds)
    choice = longce_start.Choice(longce_start.PLAN, (starts["s1"], starts["s2"]), ("ce",), (3, 4))
    return run, choice, done


def _evaluations_of(key):
    return [("evaluate", f"{key}/{c}") for c in (50, 100, 200)]


def test_longce_chain_passes_over_a_unit_that_would_not_end_in_the_budget(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain

    # alone on its device: an s1 unit needs about 120 + 3 x 210 s by its records, an s2 unit 30 + 3 x 60 s
    run, choice, done = _mocked_chain(tmp_path, monkeypatch, 500.0)
    longce_chain.chain(run, choice)
    assert done == [
        ("train", "s2/ce-s3"), *_evaluations_of("s2/ce-s3"), ("train", "s2/ce-s4"), *_evaluations_of("s2/ce-s4")
    ]  # fmt: skip
    passed = [line for line in run.log_lines if line.startswith("longce-chain: s1/ce-s3 needs about 750 s")]
    assert len(passed) == 1, run.log_lines  # said once, though asked on every turn
    run, choice, done = _mocked_chain(tmp_path / "more", monkeypatch, 5000.0)
    longce_chain.chain(run, choice)
    assert [key for stage, key in done if stage == "train"] == ["s1/ce-s3", "s2/ce-s3", "s1/ce-s4", "s2/ce-s4"]
    assert done[:4] == [("train", "s1/ce-s3"), *_evaluations_of("s1/ce-s3")]  # each unit evaluated before the next


def test_longce_chain_with_another_process_on_its_device_counts_one_evaluation_after_a_training(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain
    from longppl_reproduce.real_models.claims import claim

    run, choice, done = _mocked_chain(tmp_path, monkeypatch, 500.0)
    with claim(run.root, "longce-chain/cpu", "another") as other:  # another chain process on the device
        assert other is None
        longce_chain.chain(run, choice)
    # the other evaluates s1/ce-s3's first checkpoints while it trains: 120 + 210 s fit in 500
    assert [key for stage, key in done if stage == "train"] == ["s1/ce-s3", "s2/ce-s3", "s1/ce-s4", "s2/ce-s4"]


def test_longce_chain_waits_while_another_process_trains_on_its_device(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain, longce_start
    from longppl_reproduce.real_models.claims import claim

    run, choice, done = _mocked_chain(tmp_path, monkeypatch, 5000.0)
    training = contextlib.ExitStack()
    assert training.enter_context(claim(run.root, "longce-device", "cpu")) is None

    def wait():  # the other process saves a checkpoint, then ends its training
        done.append(("wait", len(done)))
        if len([stage for stage, _ in done if stage == "wait"]) == 1:
            os.makedirs(f"{longce_start.unit_folder(run, choice.starts[1], 'ce', 3)}/point-50")
        else:
            training.close()

    monkeypatch.setattr(longce_chain, "_wait", wait)
    longce_chain.chain(run, choice)
    # nothing trained while the device was taken; the saved checkpoint evaluated meanwhile
    assert done[:4] == [("wait", 0), ("evaluate", "s2/ce-s3/50"), ("wait", 2), ("train", "s1/ce-s3")]
    assert done.count(("evaluate", "s2/ce-s3/50")) == 1 and ("train", "s2/ce-s3") in done


def test_longce_chain_waits_for_the_processes_started_beside_it_before_choosing_a_training(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain
    from longppl_reproduce.real_models.claims import claim

    run, choice, done = _mocked_chain(tmp_path, monkeypatch, 500.0)
    other = contextlib.ExitStack()

    def wait():  # the second process started on the device joins while this one waits
        done.append(("wait", len(done)))
        assert other.enter_context(claim(run.root, "longce-chain/cpu", "the other")) is None

    trained = longce_chain.train_unit

    def train_then_the_other_leaves(*args):
        trained(*args)
        other.close()

    monkeypatch.setattr(longce_chain, "_wait", wait)
    monkeypatch.setattr(longce_chain, "train_unit", train_then_the_other_leaves)
    with other:
        longce_chain.chain(run, dataclasses.replace(choice, workers=2))
    # it waited once, then chose with a helper: s1/ce-s3 (120 + 210 s) fits in 500 s; alone it would not
    assert done[:2] == [("wait", 0), ("train", "s1/ce-s3")]
    assert any("1 of the 2 processes started on cpu have joined; waiting" in line for line in run.log_lines)
    # the other leaving later is no wait that ran out, and is not logged as one
    assert not any("going on with them" in line for line in run.log_lines), run.log_lines
    assert ("wait", 0) == done[0] and done.count(("wait", 0)) == 1 and len([d for d in done if d[0] == "wait"]) == 1


def test_longce_chain_goes_on_alone_when_the_processes_started_beside_it_do_not_join(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain

    run, choice, done = _mocked_chain(tmp_path, monkeypatch, 500.0)
    monkeypatch.setattr(longce_chain, "_wait", lambda: done.append(("wait", len(done))))
    longce_chain.chain(run, dataclasses.replace(choice, workers=3))
    waits = [entry for entry in done if entry[0] == "wait"]
    assert waits == [("wait", i) for i in range(longce_chain.PEER_WAITS)]  # a bounded wait, before anything else
    # then alone: the s1 units (120 + 3 x 210 s) do not fit in 500 s, the s2 ones do
    assert [key for stage, key in done if stage == "train"] == ["s2/ce-s3", "s2/ce-s4"]
    assert any("1 of the 3 processes started on cpu have joined after 120 s" in line for line in run.log_lines)


def test_a_device_is_named_by_the_gpu_that_cuda_visible_devices_shows(monkeypatch):
    from longppl_reproduce.real_models import longce_chain

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    named = [longce_chain.device_name(d) for d in ("cuda:0", "cuda:1", "cuda:2", "cpu", "cuda")]
    assert named == ["cuda:3", "cuda:1", "cuda:2", "cpu", "cuda"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [longce_chain.device_name(d) for d in ("cuda:0", "cuda:1")] == ["cuda:0", "cuda:1"]


def test_longce_chain_trains_beside_a_training_on_another_gpu(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain
    from longppl_reproduce.real_models.claims import claim

    # each process sees one GPU as cuda:0; a training on GPU 0 takes no turn from a process on GPU 1
    for visible, trains in (("1", True), ("0", False)):
        run, choice, done = _mocked_chain(tmp_path / visible, monkeypatch, 5000.0)
        run = dataclasses.replace(run, device="cuda:0")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        training = contextlib.ExitStack()
        assert training.enter_context(claim(run.root, "longce-device", "cuda:0")) is None  # GPU 0's trainer
        monkeypatch.setattr(longce_chain, "_wait", lambda: (done.append(("wait", 0)), training.close()))
        longce_chain.chain(run, choice)
        assert (done[0][0] == "train") is trains, (visible, done[:3])
        assert ("train", "s1/ce-s3") in done


def test_longce_chain_refuses_no_workers():
    import argparse

    from longppl_reproduce.real_models import longce_start

    for workers in (0, -1):
        args = argparse.Namespace(small=True, starts=None, arms=None, seeds=None, workers=workers)
        with pytest.raises(ValueError, match="--workers must be 1 or more"):
            longce_start.Choice.from_args(args)
    assert longce_start.Choice.from_args(argparse.Namespace(small=True, workers=None)).workers == 1


def test_longce_chain_passes_over_an_evaluation_that_would_not_end_in_the_budget(tmp_path, monkeypatch):
    from longppl_reproduce.real_models import longce_chain, longce_start

    run, choice, done = _mocked_chain(tmp_path, monkeypatch, 100.0)
    starts = {s.name: s for s in choice.starts}
    # checkpoints saved here of units trained before: an s1 one needs 210 s, an s2 one 60 s
    os.makedirs(f"{longce_start.unit_folder(run, starts['s1'], 'ce', 1)}/point-50")
    for c in (50, 100, 200):  # 50 evaluated already
        os.makedirs(f"{longce_start.unit_folder(run, starts['s2'], 'ce', 0)}/point-{c}")
    longce_chain.chain(run, dataclasses.replace(choice, seeds=(0, 1)))
    assert done == [("evaluate", "s2/ce-s0/100"), ("evaluate", "s2/ce-s0/200")]  # and no unit fits in what is left
    assert any(line.startswith("longce-chain: s1/ce-s1/50 needs about 210 s") for line in run.log_lines)
