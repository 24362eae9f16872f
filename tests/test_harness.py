"""LongPPL inside lm-evaluation-harness (``longppl.harness``): the ``longppl`` model type and tasks give
the numbers of ``longppl evaluate`` on the same cache, model and settings, across tokenizer pairs, per
document and for the corpus (weighted by key-token counts, with a bootstrap standard error); bad
inputs (a misspelt setting or task name among them) end the command with one line; the entry points
that lm_eval's plugin loading reads load the model type and the tasks.

lm-eval is the ``harness`` extra: without it these tests are skipped, except under CI (``.ci/run``
installs the extra), where they fail.
"""

import json
import math
import os
import pickle
import sys

import datasets
import numpy as np
import pytest
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, run_guarded, tiny_model

try:
    import lm_eval
except ImportError:
    if os.environ.get("CI") == "true":
        pytest.fail("lm-eval is not installed: .ci/run installs the harness extra", pytrace=False)
    pytest.skip("the harness tests need lm-eval: pip install -e '.[harness]'", allow_module_level=True)

import longppl
import longppl.harness as harness
from longppl.cache.key_token_cache import CACHE_FEATURES, KeyTokenCache
from longppl.core.scoring import DocumentResult
from longppl.harness.__main__ import main as harness_main
from longppl.harness.task import _corpus_values, bootstrap_stderr, corpus_aggregation
from longppl.tools import compute_key_tokens, evaluate_models

K, D = 47, 13
ALPHA, BETA = 0.005, -50.0  # random tiny models have small LSDs
RULE = {"alpha": ALPHA, "beta": BETA}
ITERS = 200
# (family, tokenizer) of each evaluated model; the evaluator is a Llama under byte_level_bpe(600)
PAIRS = {
    "metaspace": ("mistral", lambda: metaspace_bpe()),  # another tokenizer than the evaluator's
    "same": ("llama", lambda: byte_level_bpe()),  # the evaluator's own tokenizer
    "smaller-bpe": ("gpt2", lambda: byte_level_bpe(400)),  # the same kind, another vocabulary
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    # four documents of different lengths: their key-token counts differ
    texts = [t[700 : 700 + size] for t, size in zip(govreport_texts()[3:7], (700, 1100, 500, 900))]
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    ev_tok = byte_level_bpe()
    tiny_model("llama", len(ev_tok), seed=1).save_pretrained(root / "evaluator")
    ev_tok.save_pretrained(root / "evaluator")
    models = {}
    for seed, (name, (family, tokenizer)) in enumerate(PAIRS.items(), 2):
        tok = tokenizer()
        tiny_model(family, len(tok), seed=seed).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        models[name] = str(root / name)
    cache = str(root / "cache")
    from accelerate import PartialState

    compute_key_tokens.main(["--corpus", str(corpus), "--evaluator", str(root / "evaluator"), "--output", cache,
                             "--trunc-len", str(K), "--sliding-window", str(D)])  # fmt: skip
    PartialState._reset_state()  # compute_key_tokens set up accelerate's (process-wide) state
    return dict(root=root, texts=texts, models=models, cache=cache)


@pytest.fixture(scope="module")
def expected(files, tmp_path_factory):
    """``longppl evaluate``'s results of every model: ``{pair: result}``."""
    run = evaluate_models.main(
        [
            "--key-tokens",
            files["cache"],
            "--models",
            *files["models"].values(),
            "--alpha",
            str(ALPHA),
            "--beta",
            str(BETA),
            "--output-dir",
            str(tmp_path_factory.mktemp("evaluate")),
            "--no-progress",
            "--device",
            "cpu",
        ]  # fmt: skip
    )
    return dict(zip(files["models"], (result for _, result in run["results"])))


def run_harness(model: str, metadata: dict, tasks=("longppl",), model_type="longppl", include_path=None):
    return lm_eval.simple_evaluate(
        model=model_type,
        model_args=f"pretrained={model},device=cpu,dtype=float32",
        tasks=list(tasks),
        task_manager=harness.task_manager(include_path, metadata),
        log_samples=True,
        bootstrap_iters=ITERS,
    )


def per_document(samples: list[dict]) -> list[dict]:
    return [sample["longppl"] for sample in sorted(samples, key=lambda s: s["doc_id"])]


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_the_harness_gives_the_numbers_of_longppl_evaluate(files, expected, pair):
    out = run_harness(files["models"][pair], {"key_tokens": files["cache"], **RULE})
    reference = expected[pair]
    results = out["results"]["longppl"]
    assert sum(reference["n_key_tokens"]) > 0
    assert results["longppl,none"] == pytest.approx(reference["longppl"], rel=1e-12)
    assert results["ppl,none"] == pytest.approx(reference["ppl"], rel=1e-12)
    documents = per_document(out["samples"]["longppl"])
    assert [d["n_key_tokens"] for d in documents] == reference["n_key_tokens"]
    assert [d["n_tokens"] for d in documents] == reference["n_tokens"]
    assert [d["longppl"] for d in documents] == pytest.approx(reference["longppls"], rel=1e-12, nan_ok=True)
    assert [d["ppl"] for d in documents] == pytest.approx(reference["perplexities"], rel=1e-12)
    # the corpus value is the official script's: log LongPPLs weighted by key-token counts, which this
    # corpus makes differ from a plain (geometric) mean of the documents
    keyed = [d for d in documents if d["n_key_tokens"] > 0]
    logs = [math.log(d["longppl"]) for d in keyed]
    weighted = math.exp(sum(d["n_key_tokens"] * x for d, x in zip(keyed, logs)) / sum(d["n_key_tokens"] for d in keyed))
    assert results["longppl,none"] == pytest.approx(weighted, rel=1e-12)
    assert abs(weighted - math.exp(np.mean(logs))) > 1e-4 * weighted  # far above the tolerance
    tokens = sum(d["n_tokens"] for d in documents)
    ppl = math.exp(sum(d["n_tokens"] * math.log(d["ppl"]) for d in documents) / tokens)
    assert results["ppl,none"] == pytest.approx(ppl, rel=1e-12)
    # a bootstrap standard error over documents where the harness reports one
    for metric in ("longppl", "ppl"):
        assert results[f"{metric}_stderr,none"] == bootstrap_stderr(documents, ITERS, metric, "official") > 0


@pytest.mark.slow
def test_the_command_line_writes_the_results_json_of_longppl_evaluate(files, expected, tmp_path):
    """``python -m longppl.harness run`` end to end in a fresh process, offline: the results JSON."""
    command = [sys.executable, "-m", "longppl.harness", "run", "--model", "longppl", "--model_args",
               f"pretrained={files['models']['metaspace']},dtype=float32", "--device", "cpu", "--tasks", "longppl",
               "--metadata", f"key_tokens={files['cache']}", f"alpha={ALPHA}", f"beta={BETA}",
               "--output_path", str(tmp_path / "out")]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    done = run_guarded(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = [os.path.join(path, name) for path, _, names in os.walk(tmp_path / "out") for name in names]
    results = json.loads(open(written, encoding="utf-8").read())["results"]["longppl"]
    assert results["longppl,none"] == pytest.approx(expected["metaspace"]["longppl"], rel=1e-12)
    assert results["ppl,none"] == pytest.approx(expected["metaspace"]["ppl"], rel=1e-12)
    assert isinstance(results["longppl_stderr,none"], float)


@pytest.mark.slow
def test_a_task_yaml_of_ones_own_points_at_the_cache_with_its_dataset_path_line(files, expected, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    template = open(harness.TEMPLATE_PATH, encoding="utf-8").read()
    assert template.count("dataset_path:") == 1
    lines = [f"dataset_path: {files['cache']}" if line.startswith("dataset_path:") else line
             for line in template.splitlines()]  # fmt: skip
    (tasks / "mine.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = run_harness(files["models"]["same"], RULE, tasks=["longppl_mycache"], include_path=str(tasks))
    assert out["results"]["longppl_mycache"]["longppl,none"] == pytest.approx(expected["same"]["longppl"], rel=1e-12)


def items(*documents) -> list[dict]:
    """Per-document results as a LongPPL task gives them, from (longppl, n_key_tokens, ppl, n_tokens)."""
    out = []
    for value, keys, ppl, tokens in documents:
        key_nll = math.log(value) * keys if keys else 0.0
        out.append(DocumentResult(value, ppl, keys, tokens, key_nll, math.log(ppl) * (tokens - 1), tokens - 1).__dict__)
    return out


def test_the_corpus_value_is_weighted_by_key_token_counts_not_a_mean_of_documents():
    docs = items((2.0, 1, 3.0, 10), (10.0, 9, 5.0, 30), (float("nan"), 0, 4.0, 20))  # the last: no key tokens
    # the official script as it stands: weighted means of the logs, exponentiated
    official = corpus_aggregation("longppl", "official")(docs)
    assert official == pytest.approx(math.exp((1 * math.log(2.0) + 9 * math.log(10.0)) / 10))  # 8.51
    ppl = math.exp((10 * math.log(3.0) + 30 * math.log(5.0) + 20 * math.log(4.0)) / 60)
    assert corpus_aggregation("ppl", "official")(docs) == pytest.approx(ppl)
    # the official script before July 2025: weighted means of the values themselves
    before = corpus_aggregation("longppl", "official-pre-2025-07")(docs)
    assert before == pytest.approx((2.0 * 1 + 10.0 * 9) / 10)  # 9.2, while the mean of the two is 6
    ppl = (3.0 * 10 + 5.0 * 30 + 4.0 * 20) / 60
    assert corpus_aggregation("ppl", "official-pre-2025-07")(docs) == pytest.approx(ppl)
    # pooled: the same LongPPL as official; PPL over predicted tokens (n_tokens - 1 per document)
    assert corpus_aggregation("longppl", "pooled")(docs) == pytest.approx(official)
    ppl = math.exp((9 * math.log(3.0) + 29 * math.log(5.0) + 19 * math.log(4.0)) / 57)
    assert corpus_aggregation("ppl", "pooled")(docs) == pytest.approx(ppl)


def test_a_corpus_without_key_tokens_warns_why_longppl_is_nan():
    docs = items((float("nan"), 0, 3.0, 10), (float("nan"), 0, 5.0, 30))
    with pytest.warns(UserWarning, match="No key tokens in any of the 2 documents, so LongPPL is NaN"):
        assert math.isnan(corpus_aggregation("longppl", "official")(docs))
    assert corpus_aggregation("ppl", "official")(docs) == pytest.approx(
        math.exp((10 * math.log(3) + 30 * math.log(5)) / 40)
    )


@pytest.mark.parametrize("metric", ["longppl", "ppl"])
@pytest.mark.parametrize("aggregation", ["official", "official-pre-2025-07", "pooled"])
def test_the_bootstrap_resamples_documents_and_aggregates_each_resample_as_the_corpus(metric, aggregation):
    docs = items((2.0, 1, 3.0, 10), (10.0, 9, 5.0, 30), (float("nan"), 0, 4.0, 20), (4.0, 3, 6.0, 15))
    rng = np.random.default_rng(7)
    counts = rng.multinomial(len(docs), np.full(len(docs), 0.25), size=30).astype(np.float64)
    values = _corpus_values(counts, docs, metric, aggregation)
    aggregate = corpus_aggregation(metric, aggregation)
    for row, value in zip(counts, values):  # each resample = the corpus of the documents drawn, repeats kept
        drawn = [doc for doc, times in zip(docs, row) for _ in range(int(times))]
        assert value == pytest.approx(aggregate(drawn), nan_ok=True)
    # the standard error: the sample standard deviation of the finite resample values, drawn from the
    # documents in a canonical order (their results as sorted JSON), whatever order they come in
    docs = sorted(docs, key=lambda doc: json.dumps(doc, sort_keys=True))
    rng = np.random.default_rng(harness.task.BOOTSTRAP_SEED)
    draws = rng.multinomial(len(docs), np.full(len(docs), 0.25), size=50)
    replicate = [aggregate([d for d, t in zip(docs, row) for _ in range(int(t))]) for row in draws]
    finite = [v for v in replicate if math.isfinite(v)]
    mean = sum(finite) / len(finite)
    plain = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
    assert bootstrap_stderr(docs, 50, metric, aggregation) == pytest.approx(plain)
    # data parallelism gathers the documents rank by rank: the standard error must not change
    interleaved = docs[0::2] + docs[1::2]
    assert bootstrap_stderr(interleaved, 50, metric, aggregation) == bootstrap_stderr(docs, 50, metric, aggregation)


def written_out(rule: str, metric: str, docs: list[dict], times) -> float:
    """The corpus value of the documents drawn ``times`` each, by the official scripts' formulas."""
    if metric == "longppl":
        pairs = [(t * d["n_key_tokens"], d["longppl"]) for d, t in zip(docs, times) if d["n_key_tokens"] > 0]
    else:
        pairs = [(t * d["n_tokens"], d["ppl"]) for d, t in zip(docs, times)]
    weight = sum(w for w, _ in pairs)
    if weight == 0:
        return math.nan
    if rule == "official":  # the official script as it stands: exp of the weighted mean of the logs
        return math.exp(sum(w * math.log(v) for w, v in pairs) / weight)
    return sum(w * v for w, v in pairs) / weight  # before July 2025: the weighted mean of the values


@pytest.mark.parametrize("metric", ["longppl", "ppl"])
@pytest.mark.parametrize("rule", ["official", "official-pre-2025-07"])
def test_the_corpus_value_and_its_standard_error_follow_the_official_formulas(metric, rule):
    docs = items((2.0, 1, 3.0, 10), (10.0, 9, 5.0, 30), (float("nan"), 0, 4.0, 20), (4.0, 3, 6.0, 15))
    assert corpus_aggregation(metric, rule)(docs) == pytest.approx(written_out(rule, metric, docs, [1] * 4))
    docs = sorted(docs, key=lambda doc: json.dumps(doc, sort_keys=True))
    draws = np.random.default_rng(harness.task.BOOTSTRAP_SEED).multinomial(len(docs), np.full(len(docs), 0.25), 50)
    finite = [v for v in (written_out(rule, metric, docs, row) for row in draws) if math.isfinite(v)]
    mean = sum(finite) / len(finite)
    assert bootstrap_stderr(docs, 50, metric, rule) == pytest.approx(
        math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
    )


def one_line_error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        harness_main(argv)
    message = str(stop.value.code)
    assert message.startswith("python -m longppl.harness: error: ") and "\n" not in message, message
    return message


def cli(model: str, *metadata: str, tasks: str = "longppl", model_type: str = "longppl") -> list[str]:
    return ["run", "--model", model_type, "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
            "--tasks", tasks, *(["--metadata", *metadata] if metadata else [])]  # fmt: skip


@pytest.mark.slow  # a model loaded for each
def test_bad_inputs_end_the_command_with_one_line(files, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LONGPPL_DEBUG", raising=False)
    model, cache = files["models"]["same"], files["cache"]
    assert "has no key-token cache: pass --metadata key_tokens=" in one_line_error(cli(model))
    folder = tmp_path / "not-a-cache"
    folder.mkdir()
    assert f"{str(folder)!r} is not a key-token cache" in one_line_error(cli(model, f"key_tokens={folder}"))
    # a cache without rows (as a Hub dataset with none would be; the Hub is out of reach here)
    rows = datasets.Dataset.from_dict({name: [] for name in CACHE_FEATURES}, features=CACHE_FEATURES)
    monkeypatch.setattr(longppl, "open_cache", lambda *args: KeyTokenCache(rows))
    assert "The key-token cache 'someone/empty' of task 'longppl' has no rows: score a corpus into it" in (
        one_line_error(cli(model, "key_tokens=someone/empty"))
    )
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "0 evaluator/settings combinations of the key-token cache match (trunc_len=99)" in one_line_error(
        cli(model, f"key_tokens={cache}", "trunc_len=99")
    )
    assert "aggregation must be one of 'official', 'official-pre-2025-07', 'pooled'" in one_line_error(
        cli(model, f"key_tokens={cache}", "aggregation=mean")
    )
    assert "alpha must be a finite number" in one_line_error(cli(model, f"key_tokens={cache}", "alpha=nan"))
    # a misspelt setting is refused, not ignored (the run would have used alpha's default)
    assert "Task 'longppl': unknown setting(s) alhpa (did you mean alpha?). The settings of a LongPPL task" in (
        one_line_error(cli(model, f"key_tokens={cache}", "alhpa=0.005"))
    )
    # the harness's own model gives no per-token log-probs
    assert "only the 'longppl' model type gives: run it with --model longppl" in one_line_error(
        cli(model, f"key_tokens={cache}", model_type="hf")
    )


@pytest.mark.slow
@pytest.mark.slow  # lm_eval's task index, built twice
def test_a_misspelt_task_name_gets_the_closest_task_names(monkeypatch):
    monkeypatch.delenv("LONGPPL_DEBUG", raising=False)
    message = one_line_error(cli("no-model-is-loaded", "key_tokens=x", tasks="longpl,hellaswg"))
    assert message.endswith(
        "Tasks not found: longpl (did you mean longppl?), hellaswg (did you mean hellaswag?); "
        "`python -m longppl.harness ls tasks` lists the tasks."
    )


def test_run_help_says_what_the_arguments_do_to_a_longppl_task(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps lines to the terminal (and words at hyphens)
    with pytest.raises(SystemExit) as stop:
        harness_main(["run", "--help"])
    assert stop.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert shown.startswith("usage: python -m longppl.harness run ")
    # --limit: which documents, and what the corpus values then are
    assert (
        "Limit examples per task (integer count or fraction); for a LongPPL task, its first N documents in the "
        "key-token cache's row order (a fraction: that share of them, rounded up), so that LongPPL, PPL and "
        "their standard errors are those of these documents only"
    ) in shown
    assert "--metadata key=value sets, for every LongPPL task of the run: " + ", ".join(harness.task.SETTINGS) in shown


@pytest.mark.slow
def test_limit_scores_the_first_documents_of_the_cache(files, expected):
    """``--limit 2``: the first two texts of the cache, and the corpus values of those two alone."""
    out = lm_eval.simple_evaluate(
        model="longppl",
        model_args=f"pretrained={files['models']['same']},device=cpu,dtype=float32",
        tasks=["longppl"],
        task_manager=harness.task_manager(None, {"key_tokens": files["cache"], **RULE}),
        log_samples=True,
        bootstrap_iters=0,
        limit=2,
    )
    samples = sorted(out["samples"]["longppl"], key=lambda sample: sample["doc_id"])
    assert [sample["doc"]["row"] for sample in samples] == [0, 1]
    documents = per_document(samples)
    reference = expected["same"]
    assert [d["n_key_tokens"] for d in documents] == reference["n_key_tokens"][:2]
    assert [d["longppl"] for d in documents] == pytest.approx(reference["longppls"][:2], rel=1e-12, nan_ok=True)
    results = out["results"]["longppl"]
    for metric in ("longppl", "ppl"):
        corpus = corpus_aggregation(metric, harness.task.DEFAULT_AGGREGATION)(documents)
        assert results[f"{metric},none"] == pytest.approx(corpus, rel=1e-12)
    assert results["longppl,none"] != pytest.approx(reference["longppl"], rel=1e-6)  # not the whole corpus


def test_a_model_whose_positions_are_too_short_is_named_with_the_document(files, tmp_path):
    tok = byte_level_bpe()
    tiny_model("gpt2", len(tok), seed=5, max_positions=64).save_pretrained(tmp_path / "short")
    tok.save_pretrained(tmp_path / "short")
    message = one_line_error(cli(str(tmp_path / "short"), f"key_tokens={files['cache']}"))
    assert "has learned position embeddings for 64 positions, but document 0 of task 'longppl' is" in message


def test_other_rolling_requests_get_the_harness_answer_and_answers_pickle(files):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model = files["models"]["same"]
    ours, plain = harness.LongPPLLM(pretrained=model, device="cpu"), HFLM(pretrained=model, device="cpu")
    text = files["texts"][2]
    document = harness.DocumentRequest("loglikelihood_rolling", {}, (text,), 0, ("longppl", 0, 1))
    # the harness repeats a request to even out the processes' counts: each place gets the answer
    requests = [Instance("loglikelihood_rolling", {}, (text,), 0, ("wikitext", 0, 1)), document, document]
    answers = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    assert answers[2] is answers[1]
    assert answers[0] == pytest.approx(plain.loglikelihood_rolling(requests[:1], disable_tqdm=True)[0], rel=1e-6)
    assert not isinstance(answers[0], harness.DocumentLogProbs)
    (scores,) = longppl.score_with_model(ours.model, ours.tokenizer, [text], progress=False)
    assert np.array_equal(answers[1].scores.lp, scores.lp, equal_nan=True)
    assert answers[1] == pytest.approx(np.nansum(scores.lp.astype(np.float64)))
    again = pickle.loads(pickle.dumps(answers[1]))
    assert again == answers[1] and np.array_equal(again.scores.input_ids, scores.input_ids)


def test_the_harness_hf_evaluate_hook_loads_the_metric(tmp_path, monkeypatch):
    """lm_eval's ``hf_evaluate: true`` metrics are ``evaluate.load(name).compute``: the bare name finds
    this library's metric (docs/harness.md says why that hook is not the way to LongPPL)."""
    from lm_eval.api.registry import get_metric

    compute = get_metric("longppl", hf_evaluate_metric=True)
    assert compute is not None and compute.__self__.name == "longppl"
    assert "evaluator_model_id" in compute.__self__.inputs_description


def test_import_longppl_does_not_import_the_harness():
    code = "import sys, longppl; print('longppl.harness' in sys.modules, 'lm_eval' in sys.modules)"
    done = run_guarded([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"trunc_len": "47"}, "trunc_len must be an integer >= 1, got '47'"),
        ({"sliding_window": 0}, "sliding_window must be an integer >= 1, got 0"),
        ({"gamma": -1.0}, "gamma must be > 0"),
        ({"soft": "yes"}, "soft must be True or False, got 'yes'"),
        ({"aggregation": "mean"}, "aggregation must be one of 'official', 'official-pre-2025-07', 'pooled'"),
    ],
)
def test_task_settings_are_checked_before_the_cache_is_read(setting, message):
    with pytest.raises(ValueError, match=message):
        harness.LongPPLTask({"task": "longppl", "metadata": {"key_tokens": "no/such-cache", **setting}})


def test_the_official_rule_before_july_2025_is_a_task_setting(monkeypatch):
    """The old rule's name passes the task's check: the task goes on to read its cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Exception) as raised:
        harness.LongPPLTask(
            {"task": "longppl", "metadata": {"key_tokens": "no/such-cache", "aggregation": "official-pre-2025-07"}}
        )
    assert "aggregation" not in str(raised.value)


@pytest.mark.parametrize(
    "key, setting",
    [("alhpa", "alpha"), ("trunc-len", "trunc_len"), ("key_token", "key_tokens"), ("Beta", "beta"),
     ("aggregate", "aggregation"), ("no_lcl", "use_lcl")],
)  # fmt: skip
def test_a_misspelt_setting_is_refused_with_the_setting_it_resembles(key, setting):
    metadata = {"key_tokens": "no/such-cache", key: "1"}
    with pytest.raises(ValueError) as refused:
        harness.LongPPLTask({"task": "mine", "metadata": metadata})
    message = str(refused.value)
    assert message.startswith(f"Task 'mine': unknown setting(s) {key} (did you mean {setting}?). ")
    assert message.endswith("are " + ", ".join(harness.task.SETTINGS) + ".")


def test_other_metadata_keys_pass_and_only_those_the_task_cannot_place_are_named(recwarn):
    """lm_eval's own keys and the model's arguments (``--model_args``, which lm_eval merges into every
    task's metadata) pass silently; a key neither a setting nor close to one is named in a warning."""
    from longppl.harness.task import check_metadata

    placed = {"key_tokens": "c", "alpha": 1.0, "version": 1, "config_source": "x.yaml", "pretrained": "m",
              "dtype": "float32", "max_tokens_per_batch": 8, "trust_remote_code": False}  # fmt: skip
    check_metadata("longppl", placed)
    assert not [w for w in recwarn if "ignores the metadata" in str(w.message)]
    with pytest.warns(UserWarning, match=r"Task 'longppl' ignores the metadata attn_implementation: not a setting"):
        check_metadata("longppl", {**placed, "attn_implementation": "sdpa"})


PLUGIN_GROUPS = {"lm_eval.models": "longppl.harness.model:LongPPLLM", "lm_eval.tasks": "longppl.harness.tasks"}


def test_setup_cfg_declares_the_model_type_and_tasks_in_lm_evals_plugin_groups():
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.cfg"), encoding="utf-8")
    declared = {
        group: dict(
            line.replace(" ", "").split("=", 1) for line in config["options.entry_points"][group].split("\n") if line
        )
        for group in PLUGIN_GROUPS
    }
    assert declared == {group: {"longppl": target} for group, target in PLUGIN_GROUPS.items()}


def test_the_installed_entry_points_load_the_model_type_and_the_tasks():
    """What lm_eval's plugin loading (its development branch) does with the installed entry points: the
    model type by its class, whose ``module:name`` must be the entry point's value (lm_eval then takes the
    class ``@register_model`` registers in place of the entry point), and the task YAMLs from the folder of
    the package the ``lm_eval.tasks`` entry point names (every ``*.yaml`` under it)."""
    import importlib.metadata
    import importlib.util

    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    hint = "reinstall the project (pip install -e .): the installed metadata predates setup.cfg's entry points"
    installed = {group: {p.name: p for p in importlib.metadata.entry_points(group=group)} for group in PLUGIN_GROUPS}
    assert {group: points["longppl"].value for group, points in installed.items() if "longppl" in points} == (
        PLUGIN_GROUPS
    ), hint
    model = installed["lm_eval.models"]["longppl"].load()
    assert model is harness.LongPPLLM and issubclass(model, LM) and get_model("longppl") is model
    assert f"{model.__module__}:{model.__name__}" == PLUGIN_GROUPS["lm_eval.models"]
    spec = importlib.util.find_spec(installed["lm_eval.tasks"]["longppl"].value)
    (folder,) = spec.submodule_search_locations
    assert os.path.samefile(folder, harness.TASKS_PATH)
    # the bundled task alone: not the template's placeholder task
    assert TaskManager(include_path=folder, include_defaults=False).all_tasks == ["longppl"]


def test_the_harness_extras_pin_of_python_dateutil_is_explained_in_setup_cfg():
    """The harness extra installs python-dateutil < 3 (a venv built with the test extra has 4.x): lm-eval
    needs pytablewriter, which needs typepy[datetime], whose datetime extra caps python-dateutil below 3.
    setup.cfg says so; this reads the chain from the installed packages' metadata."""
    import importlib.metadata

    from packaging.requirements import Requirement

    def requirement(package: str, name: str, extra: str = "") -> Requirement:
        for line in importlib.metadata.requires(package) or []:
            found = Requirement(line)
            if found.name.lower() == name and (found.marker is None or found.marker.evaluate({"extra": extra})):
                return found
        raise AssertionError(f"{package} no longer requires {name}: update setup.cfg's comment on the harness extra")

    assert "datetime" in requirement("pytablewriter", "typepy").extras
    requirement("lm_eval", "pytablewriter")
    assert not requirement("typepy", "python-dateutil", "datetime").specifier.contains("3.0.0")
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.cfg"), encoding="utf-8") as handle:
        above = handle.read().split("\nharness =\n", 1)[0].splitlines()
    comment = []  # the comment lines right above the extra
    while above and above[-1].startswith("#"):
        comment.insert(0, above.pop())
    comment = " ".join(line.lstrip("# ") for line in comment)
    assert all(name in comment for name in ("pytablewriter", "typepy[datetime]", "python-dateutil<3")), comment


def test_a_peft_adapter_is_scored_as_the_adapted_model(files, tmp_path):
    """``peft=<adapter>`` (the harness loads it on the base model): the documents are scored by the
    adapted model, the same as scoring the merged model directly."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = files["models"]["same"]
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # B != 0: it changes
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(tmp_path / "adapter")
    ours = harness.LongPPLLM(pretrained=base, peft=str(tmp_path / "adapter"), device="cpu", dtype="float32")
    request = harness.DocumentRequest("loglikelihood_rolling", {}, (files["texts"][0],), 0, ("longppl", 0, 1))
    (answer,) = ours.loglikelihood_rolling([request], disable_tqdm=True)
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    ).merge_and_unload()
    tokenizer = ours.tokenizer
    (adapted,) = longppl.score_with_model(merged, tokenizer, [files["texts"][0]], progress=False)
    (plain,) = longppl.score_with_model(
        AutoModelForCausalLM.from_pretrained(base), tokenizer, [files["texts"][0]], progress=False
    )
    assert np.allclose(answer.scores.lp, adapted.lp, rtol=0, atol=1e-5, equal_nan=True)
    assert not np.allclose(answer.scores.lp, plain.lp, rtol=0, atol=1e-3, equal_nan=True)
