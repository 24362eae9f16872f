"""Tensor parallelism (``longppl.parallel.tensor_parallel``, ``longppl-score --tensor-parallel N``): an
evaluator split over two CPU processes (gloo, the same collectives as NCCL on GPUs) scores
as the unsplit evaluator does, with and without sequence parallelism, and what cannot be split is
refused in one line before any model loads.

The split rows are compared with ``reference.evaluator_scores`` (the unsplit model, full float32
logits, one window per forward): row-wise layers sum partial products over the ranks, a different
order of float32 additions, so log-probs agree to 1e-5, and key tokens exactly.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch
from helpers import accelerate_launch_on_cpu, byte_level_bpe, govreport_texts, run_guarded, tiny_model
from reference import evaluator_scores

from longppl.cache.key_token_cache import KeyTokenCache
from longppl.rules.key_tokens import key_token_mask
from longppl.settings import KeyTokenRule
from longppl.tools import compute_key_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tensor_parallel_worker.py")
SPLIT_LINEAR_WORKER = os.path.join(HERE, "split_linear_worker.py")
K, D = 40, 12
ALPHA, BETA = 0.005, -50.0  # thresholds a random tiny model's log-probs cross: some tokens key, some not
RULE = KeyTokenRule(alpha=ALPHA, beta=BETA)
FAMILIES = ("llama", "mistral", "qwen2")
# name -> (family, config changes): the three families, and one with the LM head tied to the
# embedding (its checkpoint holds no lm_head.weight; the split model must tie it again)
EVALUATORS = {**{family: (family, {}) for family in FAMILIES}, "qwen2-tied": ("qwen2", {"tie_word_embeddings": True})}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Texts, a JSONL corpus, and a saved tiny evaluator of each family (plus a GPT-2, which has no plan)."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    texts = [text[300 : 300 + size] for text, size in zip(govreport_texts()[:3], (260, 190, 330))]
    (root / "texts.json").write_text(json.dumps(texts), encoding="utf-8")
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    tokenizer = byte_level_bpe()
    for name, (family, changes) in {**EVALUATORS, "gpt2": ("gpt2", {})}.items():
        tiny_model(family, len(tokenizer), seed=3, **changes).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return dict(root=root, texts=texts, corpus=str(corpus), tokenizer=tokenizer)


def launch(arguments: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"), CUDA_VISIBLE_DEVICES="")
    return run_guarded([*accelerate_launch_on_cpu(2), *arguments], env=env, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["tensor", "sequence"])
def test_split_evaluators_score_as_the_unsplit_reference(saved, tmp_path, split):
    # "sequence": sequence parallelism on top (hidden states split over the tokens between the split
    # layers). The texts have 107, 93 and 140 tokens: two odd counts, which 2 ranks split with padding,
    # and short windows of odd lengths packed several to a forward pass.
    root = saved["root"]
    folders = [str(root / name) for name in EVALUATORS]
    done = launch([WORKER, str(tmp_path), str(root / "texts.json"), str(K), str(D), split, *folders], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, (family, changes) in EVALUATORS.items():
        ranks = [np.load(tmp_path / f"{name}-{rank}.npz", allow_pickle=False) for rank in (0, 1)]
        if split == "sequence":
            for rank in ranks:
                # [B, T of q_proj, tokens of the first norm, tokens of the backbone's output] per forward
                counts = rank["token_counts"]
                tokens = counts[:, 0] * counts[:, 1]
                assert (counts[:, 2] == (tokens + 1) // 2).all(), counts  # the norm ran on this rank's half
                assert (counts[:, 3] == tokens).all(), counts  # q_proj and the output: every token
                assert (tokens % 2 == 1).any() and (counts[:, 0] > 1).any(), counts  # odd B*T, packed windows
        else:
            assert "token_counts" not in ranks[0].files
        model = tiny_model(family, len(saved["tokenizer"]), seed=3, **changes).eval()
        key_tokens = 0
        for index, text in enumerate(saved["texts"]):
            ids, _, lp_long, lp_short = evaluator_scores(model, saved["tokenizer"], text, K, D)
            expected_long, expected_short = np.array(lp_long), np.array(lp_short)
            for rank in ranks:  # both ranks end with the same rows
                assert rank[f"ids_{index}"].tolist() == ids
                np.testing.assert_allclose(rank[f"lp_long_{index}"], expected_long, atol=TOLERANCE, equal_nan=True)
                np.testing.assert_allclose(rank[f"lp_short_{index}"], expected_short, atol=TOLERANCE, equal_nan=True)
                got = key_token_mask(rank[f"lp_long_{index}"], rank[f"lp_short_{index}"], RULE)
                want = key_token_mask(expected_long, expected_short, RULE)
                assert got.tolist() == want.tolist(), (name, index)
            key_tokens += int(want.sum())
        assert 0 < key_tokens < sum(len(text) for text in saved["texts"]), name  # the comparison has teeth


@pytest.mark.slow
def test_compiled_split_layers_compile_a_few_graphs_once_and_the_same_on_every_rank(saved, tmp_path):
    # Mistral (the 123B evaluator's family) split with sequence parallelism, its decoder layers
    # compiled, scoring the three texts one after another: a long pass of 140, 107 and 93 tokens each,
    # then batches of short windows, full and partial. dynamo must serve every length with the graphs
    # the first text made (a pass of one sequence, one of several windows, one padded with a mask;
    # and the head's 16-token probe, whose 8 tokens a rank equal this tiny model's head_dim, which
    # dynamo then fixes), the same number on both ranks. Before, it made a graph per [B, T] of a pass
    # (read from the hooks' state, a constant to it), and rank 1 twice as many (its first layer's
    # input, a view of the whole hidden states, started at a storage offset above 0).
    texts = [saved["texts"][index] for index in (2, 0, 1)]  # the longest first: its passes cover the others'
    (tmp_path / "texts.json").write_text(json.dumps(texts), encoding="utf-8")
    folder = str(saved["root"] / "mistral")
    done = launch([WORKER, str(tmp_path), str(tmp_path / "texts.json"), str(K), str(D), "compiled", folder], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recompile_limit" not in done.stderr  # no layer fell back to running eagerly
    ranks = [np.load(tmp_path / f"mistral-{rank}.npz", allow_pickle=False) for rank in (0, 1)]
    graphs = [rank["graphs"].tolist() for rank in ranks]
    assert graphs[0] == graphs[1], graphs
    assert 1 < graphs[0][0] <= 4 and graphs[0] == [graphs[0][0]] * len(texts), graphs
    # compiled, the rows are the unsplit reference's
    model = tiny_model("mistral", len(saved["tokenizer"]), seed=3).eval()
    for index, text in enumerate(texts):
        ids, _, lp_long, lp_short = evaluator_scores(model, saved["tokenizer"], text, K, D)
        for rank in ranks:
            assert rank[f"ids_{index}"].tolist() == ids
            np.testing.assert_allclose(rank[f"lp_long_{index}"], lp_long, atol=TOLERANCE, equal_nan=True)
            np.testing.assert_allclose(rank[f"lp_short_{index}"], lp_short, atol=TOLERANCE, equal_nan=True)


@pytest.mark.slow
def test_split_layers_with_biases_compute_the_whole_layers(tmp_path):
    # A column-wise layer then a row-wise one, both with a bias (none of the tested families has a
    # row-wise bias; the row-wise layer must add it once, after the all-reduce, not once per rank).
    rng = np.random.default_rng(5)
    arrays = dict(
        x=rng.normal(size=(3, 7, 6)),
        w1=rng.normal(size=(8, 6)),
        b1=rng.normal(size=8),
        w2=rng.normal(size=(5, 8)),
        b2=rng.normal(size=5) + 3.0,  # far from 0: a bias added twice shows
    )
    arrays = {name: value.astype(np.float32) for name, value in arrays.items()}
    np.savez(tmp_path / "weights.npz", **arrays)
    done = launch([SPLIT_LINEAR_WORKER, str(tmp_path / "weights.npz"), str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    x, w1, b1, w2, b2 = (arrays[name].astype(np.float64) for name in ("x", "w1", "b1", "w2", "b2"))
    expected = np.maximum(x @ w1.T + b1, 0.0) @ w2.T + b2
    for rank in (0, 1):
        got = np.load(tmp_path / f"split-linear-{rank}.npz", allow_pickle=False)
        # All-reduced, or reduce-scattered over the tokens and gathered back: the whole layers.
        np.testing.assert_allclose(got["all_reduce"], expected, atol=1e-4)
        np.testing.assert_allclose(got["reduce_scatter"], expected, atol=1e-4)
        np.testing.assert_array_equal(got["round_trip"], arrays["x"])
        # The same with the row-wise weight a tensor subclass that computes through F.linear only (an
        # fp8 evaluator's float8 weights, converted after the split): the 21 tokens padded to 22.
        np.testing.assert_allclose(got["subclass_all_reduce"], expected, atol=1e-4)
        np.testing.assert_allclose(got["subclass_reduce_scatter"], expected, atol=1e-4)
        # Each rank held its share of the 3 x 7 tokens, taken flat: ceil(21 / 2) = 11 (rank 1 padded).
        assert got["local_shape"].tolist() == [1, 11, 5]


@pytest.mark.slow
def test_longppl_score_with_two_ranks_writes_the_one_process_cache(saved, tmp_path):
    from accelerate import PartialState

    arguments = ["--corpus", saved["corpus"], "--evaluator", str(saved["root"] / "llama")]
    settings = ["--trunc-len", str(K), "--sliding-window", str(D)]
    single = str(tmp_path / "single")
    try:
        compute_key_tokens.main([*arguments, "--output", single, *settings])
    finally:
        PartialState._reset_state()
    split = str(tmp_path / "split")
    done = launch(
        ["-m", "longppl.tools.compute_key_tokens", *arguments, "--output", split, *settings, "--tensor-parallel", "2"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 documents (3 scored now, 0 already cached)" in done.stdout
    # Not bit-identical (the ranks sum partial products in another order): equal to TOLERANCE.
    # rows in commit order (each process commits its own shards): compared by text
    one, two = (KeyTokenCache.load(path).dataset.sort("text_fingerprint") for path in (single, split))
    assert one["text"] == two["text"] and one["input_ids"] == two["input_ids"]
    for name in ("lp_long", "lp_short"):
        for x, y in zip(one[name], two[name]):
            np.testing.assert_allclose(np.array(y, dtype=float), np.array(x, dtype=float), atol=TOLERANCE)
    for long_a, short_a, long_b, short_b in zip(one["lp_long"], one["lp_short"], two["lp_long"], two["lp_short"]):
        mask_a = key_token_mask(np.array(long_a, dtype=float), np.array(short_a, dtype=float), RULE)
        mask_b = key_token_mask(np.array(long_b, dtype=float), np.array(short_b, dtype=float), RULE)
        assert mask_a.tolist() == mask_b.tolist()
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []  # no shard left behind


def test_sequence_parallel_without_tensor_parallel_is_refused(saved):
    from longppl.models.loading import load_model

    with pytest.raises(
        ValueError, match=r"^sequence_parallel=True with tensor_parallel=1: .* pass tensor_parallel=N > 1"
    ):
        load_model(str(saved["root"] / "llama"), "cpu", tensor_parallel=1, sequence_parallel=True)


def test_sequence_parallel_without_decoder_layers_and_a_final_norm_is_refused(saved):
    from longppl.parallel.tensor_parallel import SplitGroup, has_llama_layout, split_tokens

    gpt2 = tiny_model("gpt2", len(saved["tokenizer"]))  # its blocks are `h`, its final norm `ln_f`
    with pytest.raises(ValueError, match=r"^sequence_parallel=True needs .* `layers` .* `norm` .*; GPT2Model has not"):
        split_tokens(gpt2.base_model, {}, SplitGroup(None, 0, 2))
    # What the default (sequence_parallel=None) asks before it turns sequence parallelism on.
    assert not has_llama_layout(gpt2.base_model)
    assert all(has_llama_layout(tiny_model(family, len(saved["tokenizer"])).base_model) for family in FAMILIES)


def refusal(saved, tmp_path, *flags) -> str:
    """``longppl-score``'s one-line error for ``flags`` (no traceback)."""
    argv = ["--corpus", saved["corpus"], "--output", str(tmp_path / "out"), *flags]
    with pytest.raises(SystemExit) as exit_info:  # run_command: sys.exit("<prog>: error: ...")
        compute_key_tokens.cli(argv)
    err = str(exit_info.value.code)
    assert ": error: " in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was made
    return err


def test_a_family_without_a_plan_is_refused(saved, tmp_path):
    err = refusal(saved, tmp_path, "--evaluator", str(saved["root"] / "gpt2"), "--tensor-parallel", "2")
    assert "--tensor-parallel=2: the evaluator's family 'gpt2' has no tensor-parallel plan" in err
    assert "--device auto" in err


def test_a_size_that_does_not_divide_the_heads_is_refused(saved, tmp_path):
    err = refusal(saved, tmp_path, "--evaluator", str(saved["root"] / "qwen2"), "--tensor-parallel", "3")
    assert "--tensor-parallel=3 does not divide the evaluator's num_attention_heads=4" in err


def test_fewer_gpus_than_asked_is_refused(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refusal(saved, tmp_path, "--evaluator", str(saved["root"] / "llama"), "--tensor-parallel", "2")
    assert "--tensor-parallel=2 asks for 2 GPUs, but this machine has 1" in err


def test_several_processes_per_gpu_are_refused(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    err = refusal(saved, tmp_path, "--evaluator", str(saved["root"] / "mistral"), "--tensor-parallel", "2")
    assert (
        "--tensor-parallel=2 with 4 processes on this machine's 2 GPUs: tensor parallelism needs one process per GPU"
        in err
    )


def test_a_single_process_is_refused(saved, tmp_path):
    err = refusal(saved, tmp_path, "--evaluator", str(saved["root"] / "llama"), "--tensor-parallel", "2")
    assert "--tensor-parallel=2 needs 2 processes per group on one machine (one per GPU), but 1 were started" in err


def test_device_with_tensor_parallel_is_refused(saved, tmp_path):
    err = refusal(
        saved, tmp_path, "--evaluator", str(saved["root"] / "llama"), "--tensor-parallel", "2", "--device", "cpu"
    )
    assert "--device cpu with --tensor-parallel 2: each rank of a tensor-parallel group uses its own GPU" in err
