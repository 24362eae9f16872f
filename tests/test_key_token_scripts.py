"""The tools around the key-token cache (longppl.tools: the longppl-score, longppl-evaluate and
longppl-visualize commands): scoring a corpus (one and two processes), evaluating models against it,
pictures; and the correlations they report."""

import csv
import html
import json
import math
import os
import re

import datasets
import evaluate
import numpy as np
import pytest
from helpers import (
    accelerate_launch_on_cpu,
    assert_same_cache,
    byte_level_bpe,
    govreport_texts,
    metaspace_bpe,
    run_guarded,
    tiny_model,
)

import longppl
from longppl.cache.key_token_cache import KeyTokenCache
from longppl.commandline.correlation import average_ranks, pearson, spearman
from longppl.core.scoring import EvaluatorScores
from longppl.models.fingerprints import ModelIdentity
from longppl.settings import KeyTokenRule
from longppl.tools import compute_key_tokens, evaluate_models, visualize_key_tokens

K, D = 47, 13
ALPHA, BETA = 0.005, -50.0
SETTINGS = ["--trunc-len", str(K), "--sliding-window", str(D)]


@pytest.fixture(scope="module")
def tools():
    from accelerate import PartialState

    yield {
        module.__name__.rsplit(".", 1)[1]: module
        for module in (compute_key_tokens, evaluate_models, visualize_key_tokens)
    }
    PartialState._reset_state()  # compute_key_tokens set up accelerate's (process-wide) state


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A JSONL corpus, a saved evaluator and two saved evaluated models (Mistral family: a saved
    Qwen2 folder would reload its tokenizer as a different class)."""
    root = tmp_path_factory.mktemp("scripts")
    texts = [t[700 : 700 + size] for t, size in zip(govreport_texts()[3:7], (700, 1100, 500, 900))]
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    tiny_model("llama", len(ev_tok), seed=1).save_pretrained(root / "evaluator")
    ev_tok.save_pretrained(root / "evaluator")
    for seed in (2, 3):
        tiny_model("mistral", len(tok), seed=seed).save_pretrained(root / f"model{seed}")
        tok.save_pretrained(root / f"model{seed}")
    return dict(
        root=root,
        texts=texts,
        corpus=str(corpus),
        evaluator=str(root / "evaluator"),
        models=[str(root / "model2"), str(root / "model3")],
    )


@pytest.fixture(scope="module")
def cache(tools, files):
    output = str(files["root"] / "cache")
    summary = tools["compute_key_tokens"].main(
        [
            "--corpus",
            files["corpus"],
            "--evaluator",
            files["evaluator"],
            "--output",
            output,
            *SETTINGS,
            "--alpha",
            str(ALPHA),
            "--beta",
            str(BETA),
        ]
    )
    assert summary["documents"] == 4 and summary["scored"] == 4 and 0 < summary["key_share"] < 1
    return output


def test_documents_too_short_for_k_are_counted_once_with_what_to_do(tools, files, tmp_path, capsys):
    # evaluator tokens of each document with its special tokens, as K counts them (window_bounds: n > K)
    lengths = [len(byte_level_bpe()(text)["input_ids"]) for text in files["texts"]]
    longest, second = max(lengths), sorted(lengths)[1]
    assert len(set(lengths)) == 4 and K < min(lengths)

    def warnings_of(*trunc_len):
        capsys.readouterr()
        output = str(tmp_path / f"cache-{'-'.join(trunc_len)}")
        common = ["--corpus", files["corpus"], "--evaluator", files["evaluator"], "--output", output]
        tools["compute_key_tokens"].main([*common, "--trunc-len", *trunc_len, "--sliding-window", str(D)])
        return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]

    # K = the longest document: none has a short-context score, the cache can give no LongPPL
    assert warnings_of(str(longest)) == [
        f"compute_key_tokens.py: warning: none of the 4 documents is longer than K={longest} evaluator tokens (the "
        f"longest has {longest}), so no token has a short-context score: this cache can give no key tokens and no "
        f"LongPPL. Score again with a --trunc-len well below {longest}, or use longer documents."
    ]
    # a ladder: under K, every document is scored; under the second-shortest, two are not
    assert warnings_of(str(K), str(second)) == [
        "compute_key_tokens.py: warning: documents of at most K evaluator tokens have no short-context score, hence "
        f"no key tokens, and LongPPL leaves them out: 2 of 4 at K={second}. A smaller --trunc-len, or longer "
        "documents, would include them."
    ]
    assert warnings_of(str(K)) == []


@pytest.mark.slow
def test_two_processes_give_the_single_process_cache(files, cache, tmp_path):
    output = str(tmp_path / "cache")
    # --multi_gpu is accelerate's torchrun launcher; without GPUs the tool joins the processes over gloo.
    # -m: each process runs the module as `python -m` would, the way to launch a packaged tool.
    command = [
        *accelerate_launch_on_cpu(2),
        "-m",
        "longppl.tools.compute_key_tokens",
        "--corpus",
        files["corpus"],
        "--evaluator",
        files["evaluator"],
        "--output",
        output,
        *SETTINGS,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"), CUDA_VISIBLE_DEVICES="")
    done = run_guarded(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 documents (4 scored now, 0 already cached)" in done.stdout
    assert_same_cache(cache, output)
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []  # shards removed


def test_new_documents_only_are_scored(tools, files, cache, tmp_path):
    output = str(tmp_path / "cache")
    KeyTokenCache.load(cache).save(output)
    more = tmp_path / "more.jsonl"
    extra = govreport_texts()[9][100:700]
    more.write_text(
        open(files["corpus"], encoding="utf-8").read() + json.dumps({"text": extra}) + "\n", encoding="utf-8"
    )
    summary = tools["compute_key_tokens"].main(
        ["--corpus", str(more), "--evaluator", files["evaluator"], "--output", output, *SETTINGS]
    )
    assert summary["documents"] == 5 and summary["scored"] == 1
    assert KeyTokenCache.load(output).texts(range(5)) == files["texts"] + [extra]
    # max_length cuts each text to its first N evaluator tokens (the cache keeps the cut text)
    summary = tools["compute_key_tokens"].main(
        [
            "--corpus",
            files["corpus"],
            "--evaluator",
            files["evaluator"],
            "--output",
            output,
            *SETTINGS,
            "--max-length",
            "120",
        ]
    )
    assert summary["scored"] == 4
    cut = KeyTokenCache.load(output)
    assert [len(cut.scores(row).input_ids) for row in range(5, 9)] == [121] * 4  # + BOS
    assert all(files["texts"][i].startswith(t) for i, t in enumerate(cut.texts(range(5, 9))))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "fine"}\n{"text": "broken\n', r"docs.jsonl, line 2 is not valid JSON"),
        ('{"text": "fine"}\n\n{"body": "x"}\n', r"docs.jsonl, line 3 has no field 'text' \(its fields: \['body'\]\)"),
        ('{"text": 17}\n', r"docs.jsonl, line 1, field 'text' is a int, not a string"),
        ('["text"]\n', r"docs.jsonl, line 1 is a JSON list, not an object"),
    ],
)
def test_bad_jsonl_lines_are_named(tools, files, tmp_path, content, message):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        tools["compute_key_tokens"].main(
            ["--corpus", str(corpus), "--evaluator", files["evaluator"], "--output", str(tmp_path / "out")]
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b'{"text": "fine"}\n{"text": "caf\xe9"}\n',
            r"docs\.jsonl, line 2 is not valid UTF-8 \(byte 0xe9 at byte 14 of the line: invalid continuation byte\); "
            r"save the file as UTF-8\.$",
        ),
        (
            b'{"text": "fine"}\n\n{"text": "a \\ud800 b"}\n',
            r"docs\.jsonl, line 3, field 'text' holds a lone surrogate '\\ud800' at character 2, which is not text",
        ),
    ],
)
def test_text_that_is_not_utf8_is_named_with_its_line(tmp_path, content, message):
    from longppl.commandline.corpus import read_documents

    corpus = tmp_path / "docs.jsonl"
    corpus.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_documents(str(corpus))


def test_output_dir_that_is_a_file_is_refused_before_any_model(tmp_path):
    taken = tmp_path / "results.txt"
    taken.write_text("x")
    args = ["--key-tokens", str(tmp_path / "no_cache"), "--models", str(tmp_path / "no_model")]
    with pytest.raises(ValueError, match=r"^--output-dir '.*results\.txt' is a file; pass a folder for results"):
        evaluate_models.main([*args, "--output-dir", str(taken)])
    with pytest.raises(
        ValueError, match=r"^--output-dir '.*results\.txt/run' is inside '.*results\.txt', which is a file"
    ):
        evaluate_models.main([*args, "--output-dir", str(taken / "run")])


def test_bad_datasets_directories(tools, files, tmp_path):
    numbers = str(tmp_path / "numbers")
    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(numbers)
    args = ["--evaluator", files["evaluator"], "--output", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=r"column 'text' holds Value\('int64'\), not strings"):
        tools["compute_key_tokens"].main(["--corpus", numbers, *args])
    with pytest.raises(ValueError, match=r"has no column 'body' \(its columns: \['text'\]\)"):
        tools["compute_key_tokens"].main(["--corpus", numbers, "--text-column", "body", *args])
    holes = str(tmp_path / "holes")
    datasets.Dataset.from_dict({"text": ["a text", None]}).save_to_disk(holes)
    with pytest.raises(ValueError, match=r"row 1 of column 'text' is a NoneType, not a string"):
        tools["compute_key_tokens"].main(["--corpus", holes, *args])


def test_output_paths_through_a_loop_of_links_are_refused_before_anything_is_read(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    taken = tmp_path / "file"
    taken.write_text("x")
    args = ["--key-tokens", str(tmp_path / "no_cache"), "--models", str(tmp_path / "no_model")]
    with pytest.raises(ValueError, match=r"^--output-dir '.*loop/run' goes through a loop of symbolic links"):
        evaluate_models.main([*args, "--output-dir", str(loop / "run")])
    for option, where, detail in (
        ("--html", loop / "a.html", "goes through a loop of symbolic links"),
        ("--histogram", taken / "h.png", "is inside '.*file', which is a file"),
        ("--histogram", tmp_path / "h.xyz", "a figure cannot be written as .xyz; name it with one of the suffixes"),
    ):
        with pytest.raises(ValueError, match=rf"^{option} '.*{where.name}'.*{detail}"):
            visualize_key_tokens.main(["--key-tokens", str(tmp_path / "no_cache"), option, str(where)])


def test_evaluate_models_against_the_cache(tools, files, cache, tmp_path):
    scores_file = tmp_path / "scores.csv"
    scores = {files["models"][0]: 41.5, files["models"][1]: 37.0}
    scores_file.write_text("model,score\n" + "".join(f"{m},{s}\n" for m, s in scores.items()), encoding="utf-8")
    out = tmp_path / "results"
    run = tools["evaluate_models"].main(
        [
            "--key-tokens",
            cache,
            "--models",
            *files["models"],
            "--output-dir",
            str(out),
            "--alpha",
            str(ALPHA),
            "--beta",
            str(BETA),
            "--benchmark-scores",
            str(scores_file),
            "--no-progress",
            "--device",
            "cpu",
        ]
    )
    metric = evaluate.load(longppl.METRIC_PATH)
    rows = []
    for name, result in run["results"]:
        expected = metric.compute(
            predictions=files["texts"],
            model_id=name,
            key_tokens=cache,
            trunc_len=K,
            sliding_window=D,
            alpha=ALPHA,
            beta=BETA,
            device="cpu",
            progress=False,
        )
        assert result["n_key_tokens"] == expected["n_key_tokens"] and sum(expected["n_key_tokens"]) > 0
        assert result["longppl"] == pytest.approx(expected["longppl"], rel=1e-9)
        assert result["ppl"] == pytest.approx(expected["ppl"], rel=1e-9)
        rows.append([name, result["longppl"], result["ppl"], sum(result["n_key_tokens"]), sum(result["n_tokens"])])
    with open(out / "results.csv", newline="") as handle:
        written = list(csv.reader(handle))
    assert written[0] == ["model", "longppl", "ppl", "key_tokens", "tokens"]
    assert [[r[0]] + [float(x) for x in r[1:]] for r in written[1:]] == rows
    payload = json.loads((out / "results.json").read_text())
    assert [r["model"] for r in payload["results"]] == files["models"] and payload["meta"]["trunc_len"] == K
    y = [scores[m] for m in files["models"]]
    x = [r[1] for r in rows]
    assert run["correlations"]["longppl"]["pearson"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert payload["meta"]["correlations"]["ppl"]["spearman"] == pytest.approx(
        np.corrcoef(np.argsort(np.argsort([r[2] for r in rows])), np.argsort(np.argsort(y)))[0, 1]
    )
    with open(out / "correlation.png", "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out)) == ["correlation.png", "longppl_outputs.json", "results.csv", "results.json"]


def test_benchmark_scores_for_a_model_not_evaluated(tools, files, cache, tmp_path):
    scores_file = tmp_path / "scores.csv"
    argv = ["--key-tokens", cache, "--models", files["models"][0], "--output-dir", str(tmp_path / "out"),
            "--benchmark-scores", str(scores_file)]  # fmt: skip
    scores_file.write_text(f"model,score\n{files['models'][0]},40\nllama-70b,55\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"names models that were not evaluated: \['llama-70b'\]"):
        tools["evaluate_models"].main(argv)
    scores_file.write_text(f"model,score\n{files['models'][0]},high\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: score 'high' .* is not a number"):
        tools["evaluate_models"].main(argv)
    assert not (tmp_path / "out").exists()  # checked before any model runs


def test_no_key_tokens_warns_why_and_skips_the_correlation(tools, files, cache, tmp_path, capsys):
    scores_file = tmp_path / "scores.csv"
    scores_file.write_text(
        "model,score\n" + "".join(f"{m},{s}\n" for m, s in zip(files["models"], (41.5, 37.0))), encoding="utf-8"
    )
    out = tmp_path / "results"
    run = tools["evaluate_models"].main(
        [
            "--key-tokens",
            cache,
            "--models",
            *files["models"],
            "--output-dir",
            str(out),
            "--alpha",
            "1000",
            "--beta",
            str(BETA),
            "--benchmark-scores",
            str(scores_file),
            "--no-progress",
            "--device",
            "cpu",
        ]
    )
    captured = capsys.readouterr()
    assert all(math.isnan(result["longppl"]) and math.isfinite(result["ppl"]) for _, result in run["results"])
    stored = KeyTokenCache.load(cache)
    lsd = np.concatenate(
        [stored.scores(row).lp_long - stored.scores(row).lp_short for row in range(len(files["texts"]))]
    )
    scored = int((~np.isnan(lsd)).sum())
    assert (
        f"evaluate_longppl.py: warning: no key tokens for {', '.join(files['models'])}, so LongPPL is NaN: none of "
        f"the {scored} evaluator tokens with a short-context score meets the key-token rule LSD > 1000 and LCL > -50 "
        f"(largest LSD {np.nanmax(lsd):.2f}; 0 tokens have LSD > 1000): alpha/beta are too strict for this corpus "
        "and evaluator. Try a lower --alpha or --beta, or --no-lcl"
    ) in captured.err
    assert (
        "evaluate_longppl.py: warning: correlation with benchmark score skipped, and no correlation.png drawn: "
        "only 0 of the 2 models with a score have a finite LongPPL and PPL, and a correlation needs at least 2."
    ) in captured.err
    assert "Correlation" not in captured.out and "correlation.png" not in captured.out
    assert run["correlations"] is None
    assert sorted(os.listdir(out)) == ["longppl_outputs.json", "results.csv", "results.json"]
    assert json.loads((out / "results.json").read_text())["meta"]["correlations"] is None


def test_evaluate_writes_only_into_its_own_folder_and_leaves_no_stale_file(tools, files, cache, tmp_path):
    scores_file = tmp_path / "scores.csv"
    scores_file.write_text(
        "model,score\n" + "".join(f"{m},{s}\n" for m, s in zip(files["models"], (41.5, 37.0))), encoding="utf-8"
    )
    out = tmp_path / "results"

    def run(alpha, folder=out):
        argv = ["--key-tokens", cache, "--models", *files["models"], "--output-dir", str(folder), "--alpha", alpha,
                "--beta", str(BETA), "--benchmark-scores", str(scores_file), "--no-progress", "--device", "cpu"]  # fmt: skip
        return tools["evaluate_models"].main(argv)

    run(str(ALPHA))
    assert (out / "correlation.png").is_file()
    (out / "notes.txt").write_text("mine")  # the user's file in the command's folder
    run("1000")  # no key tokens: no correlation, so the first run's correlation.png must not stay
    assert sorted(os.listdir(out)) == ["longppl_outputs.json", "notes.txt", "results.csv", "results.json"]
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "longppl_outputs.json").read_text())["files"] == ["results.json", "results.csv"]
    # a folder of the user's own results (no marker) is refused before any model runs, and left as it was
    own = tmp_path / "mine"
    own.mkdir()
    (own / "results.json").write_text("my results")
    with pytest.raises(ValueError, match=r"^--output-dir '.*mine' holds files this command did not write \(results\.json\)"
                       r".*choose a new or empty folder"):  # fmt: skip
        run(str(ALPHA), own)
    assert os.listdir(own) == ["results.json"] and (own / "results.json").read_text() == "my results"


def test_a_results_marker_never_leads_a_removal_out_of_its_folder(tmp_path):
    from longppl.commandline.reports import OUTPUTS_FILE, write_outputs

    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.txt").write_text("keep")
    (out / OUTPUTS_FILE).write_text(json.dumps({"command": "x", "files": ["../outside.txt", "old.csv", OUTPUTS_FILE]}))
    (out / "old.csv").write_text("stale")
    write_outputs(str(out), "test", {"new.csv": lambda path: open(path, "w").close()})
    assert (tmp_path / "outside.txt").read_text() == "keep"
    assert sorted(os.listdir(out)) == ["longppl_outputs.json", "new.csv"]


def test_pictures_from_the_cache(tools, files, cache, tmp_path):
    tricky = '<b>Tom & Jerry</b> say "hi" ' + files["texts"][2]
    # a one-row cache of a text with markup in it, from the same evaluator
    from longppl.cache.key_token_cache import KeyTokenSettings, key_token_rows
    from longppl.models.loading import load_causal_lm

    evaluator, tokenizer = load_causal_lm(files["evaluator"], "cpu", "float32")
    scores = longppl.score_with_evaluator(
        evaluator, tokenizer, [tricky], KeyTokenSettings(K, D), progress=False, per_document=True
    )
    identity = ModelIdentity.of_checkpoint(files["evaluator"], evaluator.dtype)
    one = KeyTokenCache(key_token_rows([tricky], scores, KeyTokenSettings(K, D), identity))
    one.save(str(tmp_path / "one"))
    page, png = tmp_path / "doc.html", tmp_path / "lsd.png"
    tools["visualize_key_tokens"].main(
        [
            "--key-tokens",
            str(tmp_path / "one"),
            "--html",
            str(page),
            "--histogram",
            str(png),
            "--alpha",
            str(ALPHA),
            "--beta",
            str(BETA),
        ]
    )
    page_text = page.read_text(encoding="utf-8")
    document = re.search(r'<div class="doc">(.*)</div>', page_text, re.S).group(1)
    assert "<b>" not in page_text and "Tom & Jerry" not in page_text
    assert html.unescape(re.sub(r'<span class="[^"]*"( [a-z-]+="[^"]*")*>|</span>', "", document)) == tricky
    key = scores[0].key_mask(KeyTokenRule(ALPHA, BETA))
    assert page_text.count('class="t key"') == int(key.sum()) > 0  # no two tokens of this text share a character
    first_key = int(np.flatnonzero(key)[0])
    lsd = scores[0].lp_long[first_key] - scores[0].lp_short[first_key]
    assert (
        f'class="t key" title="token {first_key}: LSD {lsd:.2f}, LCL {scores[0].lp_long[first_key]:.2f}" style='
        in page_text
    )
    assert f'title="token {K - 1}: LCL' in page_text and "no short-context score (i &lt; K=47)" in page_text
    with open(png, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_visualize_numbers_texts_from_1_as_the_space_does(tools, files, cache, tmp_path):
    page = tmp_path / "doc.html"
    for number in (1, 2, 4):
        tools["visualize_key_tokens"].main(["--key-tokens", cache, "--document", str(number), "--html", str(page)])
        shown = page.read_text(encoding="utf-8")
        document = re.search(r'<div class="doc">(.*)</div>', shown, re.S).group(1)
        assert html.unescape(re.sub(r"<[^>]*>", "", document)) == files["texts"][number - 1]  # the corpus's order
        assert f"<title>Key tokens of text {number}</title>" in shown and f"; text {number} of 4, SHA-256" in shown
    tools["visualize_key_tokens"].main(["--key-tokens", cache, "--html", str(page)])  # the default: the first
    assert "<title>Key tokens of text 1</title>" in page.read_text(encoding="utf-8")
    for number in (0, 5):
        with pytest.raises(
            ValueError,
            match=rf"^--document {number} is out of range: the cache holds 4 texts for this evaluator and settings, "
            r"numbered from 1 \(pass 1 to 4\)\.$",
        ):
            tools["visualize_key_tokens"].main(["--key-tokens", cache, "--document", str(number), "--html", str(page)])


def test_html_shows_tokens_sharing_a_character_as_one_piece():
    from longppl.views.key_token_html import key_token_html

    text = "Café au lait"  # "é" split into two byte-level tokens, both spanning character 3
    offsets = np.array([[0, 0], [0, 3], [3, 4], [3, 4], [4, 7], [7, 12]])
    nan = float("nan")
    scores = EvaluatorScores(
        np.arange(6),
        offsets,
        np.array([nan, -1.0, -0.5, -0.2, -3.0, -0.1]),
        np.array([nan, nan, -4.0, -0.3, -3.1, -2.5]),
    )
    page = key_token_html(text, scores, alpha=2.0, beta=-2.0, trunc_len=2)
    document = re.search(r'<div class="doc">(.*)</div>', page, re.S).group(1)
    assert document.count("<span") == 5 and document.count('class="t key"') == 2
    # shade of a shared piece: its largest LSD (3.5 of cap 4); the marker stands before the first token with an LSD
    assert (
        '<span class="k-end" data-label="K=2" title="the first K=2 evaluator tokens end here: before this point, '
        'no short-context score"></span><span class="t key" title="token 2: LSD 3.50, LCL -0.50 | token 3: LSD 0.10, '
        'LCL -0.20" style="background: rgba(255, 127, 31, 0.744)" tabindex="0">é</span>'
    ) in document
    assert (
        '<span class="t key" title="token 5: LSD 2.40, LCL -0.10" style="background: rgba(255, 127, 31, 0.510)" tabindex="0"> lait</span>'
        in document
    )
    assert "token 1: LCL -1.00; no short-context score (i &lt; K=2)" in document


def test_the_view_counts_key_tokens_as_the_metric_transfers_them_by_character_span():
    from longppl.views.key_token_html import TokenCounts, key_token_html

    text = "Café au lait"  # "é" split into two byte-level tokens, both spanning character 3
    offsets = np.array([[0, 0], [0, 3], [3, 4], [3, 4], [4, 7], [7, 12]])
    nan = float("nan")
    lp_long = np.array([nan, -1.0, -0.5, -0.2, -3.0, -0.1])
    lp_short = np.array([nan, nan, -4.0, -0.3, -3.1, -2.5])
    scores = EvaluatorScores(np.arange(6), offsets, lp_long, lp_short)
    # the official transfer, written out: key tokens (LSD > 2, LCL > -2) are tokens 2 and 5; their
    # characters are 3..4 and 7..12; a token lies within them when its whole span does: tokens 2, 3 and 5
    own = [(lp_long[i] - lp_short[i] > 2.0) and lp_long[i] > -2.0 for i in range(6)]
    spans = [tuple(offsets[i]) for i in range(6) if own[i]]
    within = [i for i in range(1, 6) if any(a <= offsets[i][0] and offsets[i][1] <= b for a, b in spans)]
    assert sum(own) == 2 and within == [2, 3, 5]
    assert TokenCounts.of(scores, KeyTokenRule(2.0, -2.0)) == TokenCounts(tokens=5, scored=4, key=3)
    page = key_token_html(text, scores, alpha=2.0, beta=-2.0, trunc_len=2)
    assert '<span class="count" data-count="key">3</span> key tokens of the evaluator' in page


def test_the_views_counts_are_the_metrics_under_one_byte_fallback_tokenizer():
    from helpers import SlowByteTokenizer

    from longppl.core.scoring import document_results, score_with_evaluator, score_with_model, text_key_weights
    from longppl.settings import KeyTokenSettings
    from longppl.views.key_token_html import TokenCounts

    # one token per UTF-8 byte: the bytes of "é", "—" or "北" are tokens sharing one character's span
    tokenizer = SlowByteTokenizer()
    model = tiny_model("llama", 259, seed=4)
    texts = [govreport_texts()[2][:300] + " Café — naïve 北京 façade, déjà vu. " * 6]
    rule = KeyTokenRule(ALPHA, BETA)
    (evaluator_scores,) = score_with_evaluator(model, tokenizer, texts, KeyTokenSettings(K, D), progress=False)
    model_scores = score_with_model(model, tokenizer, texts, progress=False)
    (result,) = document_results(model_scores, text_key_weights(texts, [evaluator_scores], model_scores, rule=rule))
    counts = TokenCounts.of(evaluator_scores, rule)
    own = int(evaluator_scores.key_mask(rule).sum())
    assert 0 < own < result.n_key_tokens  # bytes of one character share its span: the transfer adds some
    assert counts.tokens == result.n_tokens == len(texts[0].encode("utf-8"))
    assert counts.key == result.n_key_tokens


def test_correlations_against_plain_formulas():
    x = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    y = [2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0, 8.0]
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)

    def plain_ranks(values):  # rank = 1 + number smaller + (number equal - 1) / 2
        return [1 + sum(v < u for v in values) + (sum(v == u for v in values) - 1) / 2 for u in values]

    assert average_ranks(x).tolist() == plain_ranks(x)
    assert average_ranks(y).tolist() == plain_ranks(y)
    assert spearman(x, y) == pytest.approx(np.corrcoef(plain_ranks(x), plain_ranks(y))[0, 1], rel=1e-12)
    assert math.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])) and math.isnan(spearman([1.0], [2.0]))


def test_one_evaluator_under_two_spellings_of_its_path_is_one_combination(tools, files, cache, tmp_path, monkeypatch):
    output = str(tmp_path / "cache")
    half = tmp_path / "half.jsonl"
    half.write_text("".join(open(files["corpus"], encoding="utf-8").readlines()[:2]), encoding="utf-8")
    monkeypatch.chdir(files["root"])
    first = tools["compute_key_tokens"].main(
        ["--corpus", str(half), "--evaluator", "evaluator", "--output", output, *SETTINGS]
    )
    second = tools["compute_key_tokens"].main(
        ["--corpus", files["corpus"], "--evaluator", files["evaluator"], "--output", output, *SETTINGS]
    )
    assert (first["scored"], second["scored"]) == (2, 2)  # the same evaluator: its rows are reused
    args = [
        "--key-tokens",
        output,
        "--models",
        files["models"][0],
        "--alpha",
        str(ALPHA),
        "--beta",
        str(BETA),
        "--no-progress",
        "--device",
        "cpu",
    ]
    one_spelling = tools["evaluate_models"].main([*args, "--key-tokens", cache, "--output-dir", str(tmp_path / "a")])
    for pick in ([], ["--evaluator", "evaluator"], ["--evaluator", files["evaluator"]]):
        run = tools["evaluate_models"].main([*args, *pick, "--output-dir", str(tmp_path / "b")])
        assert run["results"][0][1]["longppls"] == one_spelling["results"][0][1]["longppls"]
        assert run["results"][0][1]["n_key_tokens"] == one_spelling["results"][0][1]["n_key_tokens"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--alpha", "nan"], "alpha must be a finite number, got nan"),
        (["--trunc-len", "0"], "trunc_len must be an integer >= 1, got 0"),
        (["--sliding-window", "-3"], "sliding_window must be an integer >= 1, got -3"),
        (["--max-length", "1"], "max_length must be an integer >= 2, got 1"),
    ],
)
def test_compute_key_tokens_refuses_what_the_metric_refuses(tools, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        tools["compute_key_tokens"].parse_args(
            ["--corpus", str(tmp_path / "c.jsonl"), "--evaluator", "ev", "--output", str(tmp_path / "o")] + flags
        )
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_small_print_of_reports():
    """The soft variant's column is a weight (it can exceed the token count); a correlation that
    prints as nan says why; a recorded command names a console script, not the venv's path to it."""
    import sys

    from longppl.commandline.correlation import undefined_because
    from longppl.commandline.reports import format_table
    from longppl.commandline.running import command_line

    result = dict(longppl=1.5, ppl=9.0, n_key_tokens=[1540.5], n_tokens=[1536])
    assert "key tokens" in format_table([("m", result)]) and "key weight" not in format_table([("m", result)])
    assert "| key weight |" in format_table([("m", result)], soft=True)
    assert undefined_because({"accuracy": [0.5, 0.5, 0.5], "LongPPL": [1.0, 2.0, 3.0]}) == (
        "accuracy take one value across all 3 models, so no correlation with them is defined"
    )
    assert undefined_because({"accuracy": [0.1, 0.5], "LongPPL": [1.0, 2.0]}) is None
    assert math.isnan(pearson([0.5, 0.5, 0.5], [1.0, 2.0, 3.0]))  # what the sentence explains
    argv = sys.argv
    try:
        sys.argv = ["/home/me/venv/bin/longppl-reproduce", "--config", "c.yaml"]
        assert command_line("x") == "longppl-reproduce --config c.yaml"
        sys.argv = [os.path.abspath("scripts/reproduce_longppl.py"), "--stages", "report"]
        assert command_line("x") == f"{os.path.relpath(sys.argv[0])} --stages report"
    finally:
        sys.argv = argv


def test_a_cache_says_what_it_holds(cache):
    loaded = KeyTokenCache.load(cache)
    assert repr(loaded) == f"KeyTokenCache({os.path.realpath(cache)!r}, 4 rows: {loaded.describe()})"
    assert loaded.describe().startswith("it holds 4 rows from evaluator ")
    assert repr(KeyTokenCache()) == "KeyTokenCache(in memory, 0 rows: it is empty)"


@pytest.mark.slow  # scores the corpus three times
def test_a_second_evaluator_in_one_cache_is_announced_and_chosen_as_the_error_shows(tools, files, tmp_path, capsys):
    output = str(tmp_path / "cache")
    tiny_model("llama", len(byte_level_bpe()), seed=7).save_pretrained(tmp_path / "judge")
    byte_level_bpe().save_pretrained(tmp_path / "judge")
    score = ["--corpus", files["corpus"], "--output", output, *SETTINGS]
    tools["compute_key_tokens"].main([*score, "--evaluator", files["evaluator"]])
    assert "warning" not in capsys.readouterr().err
    tools["compute_key_tokens"].main([*score, "--evaluator", str(tmp_path / "judge")])
    warning = capsys.readouterr().err
    [line] = [line for line in warning.splitlines() if "warning" in line]
    assert line.startswith("compute_key_tokens.py: warning: --output") and files["evaluator"] in line
    tools["compute_key_tokens"].main([*score, "--evaluator", str(tmp_path / "judge")])  # nothing new: no warning
    assert "warning" not in capsys.readouterr().err
    show = ["--key-tokens", output, "--document", "1", "--html", str(tmp_path / "doc.html")]
    with pytest.raises(ValueError, match="2 evaluator/settings") as err:
        tools["visualize_key_tokens"].main(show)
    start = re.search(r"evaluator \[([0-9a-f]{12})\]", str(err.value)).group(1)  # as the message prints it
    for pick in ("evaluator", files["evaluator"], start, start[:6]):
        tools["visualize_key_tokens"].main([*show, "--evaluator", pick])
        page = (tmp_path / "doc.html").read_text(encoding="utf-8")
        assert html.escape(f"Evaluator {files['evaluator']} (") in page and "judge" not in page, pick
