"""``ScoreKeyTokens``, the datatrove step: documents from datatrove's readers, each task reading its
own files, rows committed per block and resumed after a kill, curation columns on ``doc.metadata``;
the same pipeline under the local, Ray and Slurm executors; bad input."""

import contextlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import HANG_GUARD_S, assert_same_cache, byte_level_bpe, govreport_texts, hang, run_guarded, tiny_model
from test_cache_shards import direct_curation, files_state, require_datatrove

from longppl.cache.key_token_cache import KeyTokenCache, compact_cache
from longppl.settings import KeyTokenSettings

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "datatrove_worker.py")
K, D = 31, 11
FILES = 5  # input files; 3 tasks read files 0,3 | 1,4 | 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """5 JSONL files of 3 documents, a saved tiny evaluator, and ``longppl score``'s cache of all 15."""
    require_datatrove()
    from longppl.tools import compute_key_tokens

    root = tmp_path_factory.mktemp("pipeline")
    texts = [t[200 : 200 + 120 + 23 * i] for i, t in enumerate(govreport_texts()[:13] * 2)][:15]
    (root / "input").mkdir()
    for f in range(FILES):
        lines = [json.dumps({"text": t, "id": f"doc{3 * f + i}"}) for i, t in enumerate(texts[3 * f : 3 * f + 3])]
        (root / "input" / f"part{f}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    tokenizer = byte_level_bpe()
    tiny_model("llama", len(tokenizer), seed=1).save_pretrained(root / "evaluator")
    tokenizer.save_pretrained(root / "evaluator")
    reference = str(root / "reference")
    compute_key_tokens.main(["--corpus", str(root / "all.jsonl"), "--evaluator", str(root / "evaluator"),
                             "--output", reference, "--trunc-len", str(K), "--sliding-window", str(D)])  # fmt: skip
    return dict(
        root=root, input=str(root / "input"), evaluator=str(root / "evaluator"), texts=texts, reference=reference
    )


@pytest.fixture
def caplog_loguru():
    """The messages datatrove's logger (loguru) emits during the test, one string each."""
    from datatrove.utils.logging import logger

    messages = []
    sink = logger.add(lambda message: messages.append(str(message).strip()), level="INFO")
    yield messages
    with contextlib.suppress(ValueError):  # an executor's run removes every handler (it installs its own)
        logger.remove(sink)


def config(corpus, tmp_path, **changes) -> dict:
    values = dict(executor="local", input=corpus["input"], evaluator=corpus["evaluator"], cache=str(tmp_path / "cache"),
                  logs=str(tmp_path / "logs"), output=str(tmp_path / "output"), tasks=3, workers=1, trunc_len=K,
                  sliding_window=D, shard_documents=2, die=None, pause=None)  # fmt: skip
    values.update(changes)
    return values


def run_worker(values: dict, tmp_path) -> subprocess.CompletedProcess:
    """The pipeline in a fresh interpreter (``datatrove_worker.py``), under the hang guard."""
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.json"
    path.write_text(json.dumps(values), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    return run_guarded(
        [sys.executable, WORKER, str(path)], env=env, capture_output=True, text=True, start_new_session=True
    )


def wait_until(done, what: str) -> None:
    """Poll ``done()`` every half second; past the hang guard the test fails saying it was the time."""
    import time

    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        if time.monotonic() > deadline:
            hang(what, HANG_GUARD_S)
        time.sleep(0.5)


def run_here(values: dict) -> None:
    """The pipeline in this process (the local executor, one worker)."""
    from distributed import datatrove_worker

    datatrove_worker.main_config(values)


def output_documents(output: str) -> dict[str, list[dict]]:
    """``{output file: [document dict, ...]}`` of the JsonlWriter's files."""
    found = {}
    for name in sorted(os.listdir(output)):
        with open(os.path.join(output, name), encoding="utf-8") as handle:
            found[name] = [json.loads(line) for line in handle if line.strip()]
    return found


def stats_of(logs: str, rank: int) -> dict:
    """The step's counters of task ``rank`` (``scored``, ``cached``, ``no text``) from datatrove's stats."""
    with open(os.path.join(logs, "stats", f"{rank:05d}.json"), encoding="utf-8") as handle:
        steps = json.load(handle)
    step = next(s for s in steps if s["name"] == "Scorer: LongPPL key tokens")
    return {name: value["total"] if isinstance(value, dict) else value for name, value in step["stats"].items()}


def assert_columns_match_rows(documents: list[dict], cache_path: str) -> None:
    """Each document's ``longppl_`` columns equal the curation of its cache row, computed token by token."""
    cache = KeyTokenCache.load(cache_path)
    rows = dict(zip(cache.dataset["text_fingerprint"], range(len(cache))))
    for doc in documents:
        meta = doc["metadata"]
        scores = cache.scores(rows[meta["longppl_text_fingerprint"]])
        expected = direct_curation(scores.lp_long, scores.lp_short, K, 2.0, -2.0)
        for name, value in expected.items():
            got = meta["longppl_" + name]
            got = float("nan") if got is None else got  # JSON has no NaN: the writer gives null
            assert got == pytest.approx(value, rel=1e-5, abs=1e-5, nan_ok=True), (doc["id"], name)


@pytest.mark.slow
def test_each_task_reads_its_own_files_and_the_cache_equals_longppl_scores(corpus, tmp_path):
    values = config(corpus, tmp_path)
    run_here(values)
    assert_same_cache(corpus["reference"], values["cache"])
    # task r read files r, r+3 only (datatrove's shard of the sorted files): its output holds their documents
    outputs = output_documents(values["output"])
    assert sorted(outputs) == ["00000.jsonl", "00001.jsonl", "00002.jsonl"]
    for rank, name in enumerate(sorted(outputs)):
        files = {os.path.basename(d["metadata"]["file_path"]) for d in outputs[name]}
        assert files == {f"part{f}.jsonl" for f in range(rank, FILES, 3)}
        assert len(outputs[name]) == 3 * len(files)
        assert stats_of(values["logs"], rank)["scored"] == 3 * len(files)
    assert_columns_match_rows([d for docs in outputs.values() for d in docs], values["cache"])
    # run again (a fresh logging folder: every task runs): nothing scored, the cache unchanged, the same columns
    before = files_state(values["cache"])
    again = dict(values, logs=str(tmp_path / "logs-again"), output=str(tmp_path / "output-again"))
    with pytest.MonkeyPatch.context() as patch:  # every document is cached: the evaluator is not even loaded
        patch.setattr("longppl.models.loading.load_model", lambda *a, **k: pytest.fail("the evaluator was loaded"))
        run_here(again)
    assert files_state(values["cache"]) == before
    assert [stats_of(again["logs"], r) for r in range(3)] == [{"cached": 6}, {"cached": 6}, {"cached": 3}]
    assert output_documents(again["output"]) == outputs


@pytest.mark.slow
@pytest.mark.parametrize("point", ["committed", "written", "renamed"])
def test_a_task_killed_mid_run_or_mid_commit_resumes_from_its_shards(corpus, tmp_path, point):
    values = config(corpus, tmp_path, die=f"1:{point}:2")
    killed = run_worker(values, tmp_path)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL: no handler ran
    committed = len(KeyTokenCache.load(values["cache"]))
    assert committed == 6 + (4 if point == "committed" else 2)  # task 0's 6, task 1's shards before the kill
    resumed = run_worker(dict(values, die=None), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(values["logs"], "completions"))) == ["00000", "00001", "00002"]
    assert_same_cache(corpus["reference"], values["cache"])
    # task 1 resumed: the rows it had committed were read, not scored again
    kept = 4 if point == "committed" else 2
    assert stats_of(values["logs"], 1) == {"cached": kept, "scored": 6 - kept}
    assert_columns_match_rows(output_documents(values["output"])["00001.jsonl"], values["cache"])


def test_the_former_options_form_still_runs_with_a_deprecation_message(corpus, tmp_path):
    from longppl.tools.score_pipeline import ScoreKeyTokens

    options = ["--corpus", str(corpus["root"] / "all.jsonl"), "--evaluator", corpus["evaluator"],
               "--output", str(tmp_path / "cache")]  # fmt: skip
    with pytest.warns(FutureWarning, match=r"ScoreKeyTokens\(options\) .* deprecated.*datatrove reader"):
        step = ScoreKeyTokens(options)
    assert step.options == options


def test_the_cache_index_finds_rows_by_the_whole_fingerprint_where_the_first_bytes_agree(tmp_path):
    """The index keeps 8 bytes of each fingerprint: rows that agree there are told apart by the rest."""
    import pyarrow as pa
    from distributed.cache_writer_worker import IDENTITY, SETTINGS, synthetic_rows

    from longppl.cache.key_token_cache import append_rows
    from longppl.models.fingerprints import text_fingerprint
    from longppl.tools.score_pipeline import _CacheIndex

    require_datatrove()
    texts = ["first text here", "second text here", "third text here"]
    rows = synthetic_rows(texts, seed=3)
    real = text_fingerprint(texts[0])
    twin = real[:16] + "f" * 48  # the first 8 bytes of the first row's, another tail (a crafted key)
    table = rows.data.table
    column = table.column("text_fingerprint").to_pylist()
    column[1] = twin
    table = table.set_column(table.schema.get_field_index("text_fingerprint"), "text_fingerprint", pa.array(column))
    append_rows(str(tmp_path / "cache"), rows.__class__(table, info=rows.info))
    index = _CacheIndex(str(tmp_path / "cache"), SETTINGS, IDENTITY.fingerprint)
    cache = KeyTokenCache.load(str(tmp_path / "cache"))
    for fingerprint, row in ((real, 0), (twin, 1), (text_fingerprint(texts[2]), 2)):
        got, want = index.scores(fingerprint), cache.scores(row)
        assert np.array_equal(got.lp_short, want.lp_short, equal_nan=True) and got.lp_short.size > 0
    assert index.scores(real[:16] + "e" * 48) is None  # the same first bytes, a key the cache lacks
    assert _CacheIndex(str(tmp_path / "cache"), KeyTokenSettings(5, 2), IDENTITY.fingerprint).scores(real) is None


# ---- bad input ----


def test_arguments_are_checked_when_the_step_is_built(corpus, tmp_path):
    from longppl.tools.score_pipeline import ScoreKeyTokens

    with pytest.raises(ValueError, match="needs an evaluator"):
        ScoreKeyTokens(None)
    with pytest.raises(ValueError, match="without its tokenizer: pass tokenizer="):
        ScoreKeyTokens(tiny_model("llama", 600))
    with pytest.raises(ValueError, match="evaluator=.*no-such-model"):
        ScoreKeyTokens(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="settings must be a KeyTokenSettings"):
        ScoreKeyTokens(corpus["evaluator"], (K, D))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(ValueError, match="cache=.* is a folder holding other files"):
        ScoreKeyTokens(corpus["evaluator"], KeyTokenSettings(K, D), cache=str(tmp_path / "notes"))


def test_a_document_without_text_is_passed_on_without_columns_in_one_line(corpus, tmp_path, caplog_loguru):
    from datatrove.data import Document

    from longppl.tools.score_pipeline import ScoreKeyTokens

    step = ScoreKeyTokens(corpus["evaluator"], KeyTokenSettings(K, D), cache=str(tmp_path / "cache"))
    documents = [Document(text=corpus["texts"][0], id="a"), Document(text="", id="empty"),
                 Document(text=None, id="none"), Document(text=corpus["texts"][1], id="b")]  # fmt: skip
    out = list(step.run(iter(documents), rank=0, world_size=1))
    assert [d.id for d in out] == ["a", "empty", "none", "b"]
    assert "longppl_key_share" in out[0].metadata and "longppl_key_share" in out[3].metadata
    assert out[1].metadata == {} and out[2].metadata == {}
    warnings = [m for m in caplog_loguru if "has no text" in m]
    assert len(warnings) == 1 and "document 'empty'" in warnings[0] and "LambdaFilter" in warnings[0]
    assert step.stats["no text"].total == 2 and step.stats["scored"].total == 2
    assert len(KeyTokenCache.load(str(tmp_path / "cache"))) == 2


def test_documents_past_the_evaluators_positions_are_said_once_per_task(tmp_path, caplog_loguru, recwarn):
    """An evaluator trained on fewer positions than the documents hold: one line for the task, with the
    count, instead of one warning a document."""
    from datatrove.data import Document

    from longppl.tools.score_pipeline import ScoreKeyTokens

    tokenizer = byte_level_bpe()
    model = tiny_model("llama", len(tokenizer), seed=1, max_positions=64)
    step = ScoreKeyTokens(model, KeyTokenSettings(K, D), tokenizer=tokenizer)
    texts = [t[200:700] for t in govreport_texts()[:3]]  # well over 64 tokens each
    out = list(step.run(iter([Document(text=t, id=str(i)) for i, t in enumerate(texts)]), rank=0, world_size=1))
    assert len(out) == 3
    said = [m for m in caplog_loguru if "trained on" in m]
    assert len(said) == 1 and "task 0: 3 of the 3 documents scored are longer than the 64 positions" in said[0]
    assert not [w for w in recwarn if "positions" in str(w.message)]


def test_an_input_file_not_in_the_readers_format_says_so_in_one_line(corpus, tmp_path):
    import datasets

    (tmp_path / "input").mkdir()
    datasets.Dataset.from_dict({"text": corpus["texts"][:2]}).to_parquet(str(tmp_path / "input" / "part0.jsonl"))
    values = config(corpus, tmp_path, input=str(tmp_path / "input"), tasks=1)
    run_here(values)
    with open(os.path.join(values["logs"], "logs", "task_00000.log"), encoding="utf-8") as handle:
        lines = [line for line in handle if "received no documents" in line]
    assert len(lines) == 1 and "reader's format" in lines[0]
    assert not os.path.exists(values["cache"]) or len(KeyTokenCache.load(values["cache"])) == 0


@pytest.mark.slow
def test_a_reader_that_gives_every_task_the_same_documents_leaves_one_row_each_after_compaction(corpus, tmp_path):
    (tmp_path / "input").mkdir()
    for f in range(3):  # the same file three times: every task scores the same three documents
        shutil.copy(os.path.join(corpus["input"], "part0.jsonl"), tmp_path / "input" / f"copy{f}.jsonl")
    # three workers at once: each task finds the cache without the others' rows and scores the three itself
    values = config(corpus, tmp_path, input=str(tmp_path / "input"), workers=3)
    done = run_worker(values, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    cache = KeyTokenCache.load(values["cache"])
    assert 3 <= len(cache) <= 9 and len(set(cache.dataset["text_fingerprint"])) == 3
    assert compact_cache(values["cache"])["rows"] == 3  # the repeated rows (equal: scored alone) dropped
    reference = KeyTokenCache.load(corpus["reference"])
    wanted = [r for r, t in enumerate(reference.dataset["text"]) if t in set(corpus["texts"][:3])]
    subset = str(tmp_path / "reference-subset")
    KeyTokenCache(reference.dataset.select(wanted)).save(subset)
    assert_same_cache(subset, values["cache"])


@pytest.mark.slow
def test_two_pipelines_with_other_settings_keep_their_rows_side_by_side_in_one_cache(corpus, tmp_path):
    first = config(corpus, tmp_path)
    second = config(corpus, tmp_path, trunc_len=21, sliding_window=7, logs=str(tmp_path / "logs-21"),
                    output=str(tmp_path / "output-21"))  # fmt: skip
    run_here(first)
    run_here(second)
    cache = KeyTokenCache.load(first["cache"])
    assert sorted((c["trunc_len"], c["rows"]) for c in cache.configurations()) == [(21, 15), (31, 15)]
    # the second pipeline scored every document (another setting is another row), reading none of the first's
    assert sum(stats_of(second["logs"], r).get("cached", 0) for r in range(3)) == 0
    settings, _, rows = cache.select(trunc_len=K)
    subset = str(tmp_path / "ours")
    KeyTokenCache(cache.dataset.select(rows)).save(subset)
    assert_same_cache(corpus["reference"], subset)


# ---- the same pipeline under Ray and Slurm, for real (one machine) ----


def require(what: str, present: bool, how: str) -> None:
    """Fail under CI, which installs and starts ``what`` (``.ci/run``); skip, saying why, elsewhere."""
    if not present:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} is missing: CI provides it ({how})")
        pytest.skip(f"{what} is missing: {how}")


@pytest.mark.slow
def test_under_ray_a_worker_killed_mid_task_is_resubmitted_and_resumes_to_the_local_cache(corpus, tmp_path):
    """A local Ray cluster (ray.init, 2 CPU workers) runs the 3 tasks; task 1's worker process is killed
    (SIGKILL) after its first shard; Ray reports the actor lost and datatrove resubmits the task, which
    reads the committed shard instead of scoring it again. About 30 s on 2 cores."""
    import importlib.util

    require("ray", importlib.util.find_spec("ray") is not None, "pip install -e '.[corpus]'")
    values = config(corpus, tmp_path, executor="ray", workers=2, die="1:committed:1")
    done = run_worker(values, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert os.path.exists(os.path.join(values["logs"], "died-once"))  # task 1's worker was killed
    assert sorted(os.listdir(os.path.join(values["logs"], "completions"))) == ["00000", "00001", "00002"]
    assert_same_cache(corpus["reference"], values["cache"])
    assert stats_of(values["logs"], 1) == {"cached": 2, "scored": 4}  # the shard committed before the kill
    assert_columns_match_rows(output_documents(values["output"])["00001.jsonl"], values["cache"])


def slurm_is_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    found = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return found.returncode == 0 and any(s in found.stdout for s in ("idle", "mix", "alloc"))


def slurm_settled() -> bool:
    """Whether the cluster is up, after letting a node finish what the previous test left it doing (it
    shows ``comp`` while the cancelled jobs complete, ``drng`` while draining): those states pass, a
    node down or no Slurm at all does not."""
    import time

    for _ in range(120):  # a node completing jobs settles in seconds; this only bounds the wait
        if slurm_is_up():
            return True
        found = (
            subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
            if shutil.which("sinfo")
            else None
        )
        if found is None or found.returncode != 0 or not any(s in found.stdout for s in ("comp", "drng")):
            return False
        time.sleep(1)
    return slurm_is_up()


def wait_for_job(job: str) -> None:
    """Until the job array ``job`` has no task pending or running (under the hang guard)."""

    def ended() -> bool:
        queued = subprocess.run(["squeue", "-h", "-j", job, "-t", "PD,R,CG,CF"], capture_output=True, text=True)
        return queued.returncode == 0 and not queued.stdout.strip()

    wait_until(ended, f"the Slurm job {job}")


def submit(values: dict, tmp_path) -> str:
    done = run_worker(values, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("JOB ")[-1].split()[0]


def step_daemons() -> list[int]:
    """The pids of the ``slurmstepd`` processes on this machine (the single node's job and batch steps)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm", encoding="utf-8") as handle:
                    if handle.read().strip() == "slurmstepd":
                        found.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return found


def slurm_node() -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split()[0]


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["task", "node"])
def test_under_slurm_a_lost_array_task_resumes_when_the_pipeline_runs_again(corpus, tmp_path, lost):
    """A job array of 3 tasks on the single-node Slurm of scripts/slurm/start_local_slurm.sh (CI starts
    it). Once task 1 has committed a shard, either it is cancelled (``scancel``): running the pipeline
    again submits task 1 alone; or its node is set DOWN, which kills every task running there as a lost
    node does, and back up: Slurm requeues those tasks itself. Either way task 1 resumes from its shard.
    About 25 s (task) and 40 s (node) on 2 cores."""
    require("a Slurm cluster", slurm_settled(), "run scripts/slurm/start_local_slurm.sh as root")
    # a job name of its own: datatrove also submits a job merging the stats, which waits on the array's
    # success (never, for the interrupted run); the test cancels it by that name at the end
    name = f"longppl-test-{os.getpid()}-{tmp_path.name}"
    values = config(corpus, tmp_path, executor="slurm", workers=-1, pause={"rank": 1, "seconds": 2.0}, job_name=name)
    node = slurm_node()
    try:
        interrupt_and_rerun(corpus, tmp_path, values, lost, node)
    finally:
        subprocess.run(["scancel", "--name", name], check=False)
        if lost == "node":
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)


def interrupt_and_rerun(corpus, tmp_path, values: dict, lost: str, node: str) -> None:
    job = submit(values, tmp_path)
    log = os.path.join(values["logs"], "logs", "task_00001.log")
    wait_until(
        lambda: os.path.exists(log) and "task 1: committed" in open(log, encoding="utf-8").read(),
        "task 1 of the Slurm job, before its first commit",
    )
    if lost == "task":
        subprocess.run(["scancel", f"{job}_1"], check=True)
        wait_for_job(job)
    else:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=longppl-test"], check=True)
        # the tasks that ran there are killed; wait until their processes are gone (Slurm requeues them at
        # once, and a requeued task launched while its old copy still exits drains the node). slurmd counts
        # a job as running until its step daemons have exited, after the steps have left `listpids`
        wait_until(
            lambda: (
                "No job steps exist" in subprocess.run(["scontrol", "listpids"], capture_output=True, text=True).stderr
                and not step_daemons()
            ),
            "the tasks of the node set DOWN, exiting",
        )
        # (refused when the node has come back on its own: ReturnToService=2)
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
        wait_until(slurm_is_up, "the Slurm node, coming back")
        # Slurm requeues a lost node's batch jobs (JobRequeue=1, its default) to start a while later: now
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        wait_for_job(job)
    unfinished = sorted(set(range(3)) - {int(n) for n in os.listdir(os.path.join(values["logs"], "completions"))})
    assert unfinished == ([1] if lost == "task" else [])  # the lost node's tasks were requeued and resumed
    assert 2 <= len(KeyTokenCache.load(values["cache"])) <= 15
    if unfinished:
        again = submit(dict(values, pause=None), tmp_path)
        with open(os.path.join(values["logs"], "ranks_to_run.json"), encoding="utf-8") as handle:
            assert json.load(handle) == unfinished  # only the unfinished tasks run again
        wait_for_job(again)
    assert sorted(os.listdir(os.path.join(values["logs"], "completions"))) == ["00000", "00001", "00002"]
    assert_same_cache(corpus["reference"], values["cache"])
    assert stats_of(values["logs"], 1)["cached"] >= 2
    assert_columns_match_rows(output_documents(values["output"])["00001.jsonl"], values["cache"])
