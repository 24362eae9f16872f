"""The reproduction's run folder (longppl_reproduce.common.run_folder): stage timings that several processes
working on one folder (one per GPU, each on its own seeds) add to without losing an entry, and the
records it reads back checked as they are read: a file cut off, not JSON or of the wrong shape is one
error naming it and what to do, never a traceback of the code that used it."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from helpers import join_guarded
from longppl_reproduce.common import stages
from longppl_reproduce.common.run_folder import RunFolder, read_texts

ADDS = 150


def _add_many(root: str, name: str) -> None:
    run = RunFolder(root, log=lambda *_: None)
    for _ in range(ADDS):
        run.add_seconds("finetune", name, 0.5)
        run.add_seconds("stage", "finetune", 1.0)


@pytest.mark.slow  # fresh interpreters or processes: seconds each
def test_processes_adding_timings_to_one_folder_lose_no_entry(tmp_path):
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_add_many, args=(str(tmp_path), f"arm-{i}")) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        join_guarded(worker)
        assert worker.exitcode == 0
    timings = RunFolder(str(tmp_path)).timings()
    # every process's own entry and the shared one hold every call: a read-add-write race loses some
    assert {name: e["calls"] for name, e in timings["finetune"].items()} == {f"arm-{i}": ADDS for i in range(3)}
    assert timings["stage"]["finetune"] == {"seconds": 3 * ADDS * 1.0, "calls": 3 * ADDS}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timings.json"]  # no lock file left behind


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[1, 2, 3]", "has the wrong shape: a JSON list, not an object"),
        ('{"stage": [1]}', "has the wrong shape: 'stage' holds a list, not {name: {seconds, calls}}"),
        ('{"stage": {"data": {"seconds": "1"}}}', "has the wrong shape: stage.data = {'seconds': '1'}, not "),
        ('{"stage": {"da', "is not JSON (Unterminated string starting at: line 1, column 12)"),
        ("", "is not JSON (Expecting value: line 1, column 1)"),
    ],
)
def test_timings_of_the_wrong_shape_or_cut_off_are_named_and_every_later_call_says_so(tmp_path, content, problem):
    run = RunFolder(str(tmp_path), log=lambda *_: None)
    (tmp_path / "timings.json").write_text(content)
    path = tmp_path / "timings.json"
    for call in (run.timings, lambda: run.add_seconds("stage", "data", 1.0)):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value).startswith(f"{path} {problem}")
        assert str(error.value).endswith("delete it and run again (only the wall times of the calls before are lost).")
    os.remove(path)  # what the message says to do
    run.add_seconds("stage", "data", 1.0)
    assert run.timings() == {"stage": {"data": {"seconds": 1.0, "calls": 1}}}


def test_a_cut_off_or_misshapen_stage_record_is_named_with_what_to_do(tmp_path):
    run = RunFolder(str(tmp_path), log=lambda *_: None)
    redo = "delete it and run again, and the stage that writes it computes it again."
    calibration = tmp_path / "eval" / "calibration.json"
    calibration.parent.mkdir()
    calibration.write_text("")  # cut off before its first byte
    with pytest.raises(ValueError) as error:
        stages.calibrated_alpha(run)
    assert str(error.value) == f"{calibration} is not JSON (Expecting value: line 1, column 1): {redo}"
    calibration.write_text('{"beta": -2.0}')  # an object without the key the run reads
    with pytest.raises(ValueError) as error:
        stages.calibrated_alpha(run)
    assert str(error.value) == f"{calibration} has no 'alpha' where the run reads one (its keys: ['beta']): {redo}"
    member = tmp_path / "eval" / "members" / "pi2-s0.json"
    member.parent.mkdir()
    member.write_text('{"member": "pi2-s0", "lin')
    with pytest.raises(ValueError, match=rf"^{member} is not JSON \(Unterminated string .*\): {redo}$"):
        run.read_json("eval", "members", "pi2-s0.json")
    member.write_text('"pi2-s0"')
    with pytest.raises(ValueError) as error:
        run.read_json("eval", "members", "pi2-s0.json")
    assert str(error.value) == f"{member} has the wrong shape: a JSON str, not an object: {redo}"
    member.write_text('{"longppl": {"primary": {"ppl": 3.0}}}')  # a nested key is checked as well
    with pytest.raises(ValueError, match=rf"^{member} has no 'longppl' where the run reads one .*: {redo}$"):
        run.read_json("eval", "members", "pi2-s0.json")["longppl"]["primary"]["longppl"]


def test_the_texts_a_run_wrote_are_read_naming_a_bad_line(tmp_path):
    path = tmp_path / "finetune.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b\n')
    with pytest.raises(ValueError, match=rf"^{path}, line 2 is not valid JSON"):
        read_texts(str(path))
