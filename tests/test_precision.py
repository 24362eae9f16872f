"""The evaluator's precision (``evaluator_precision``, ``longppl score --evaluator-precision``;
``longppl.models.precision``): what fp8 converts, its one-line refusals (the CPU, a GPU without
float8 tensor cores, torchao missing or too old, ...), the compile default, and the cache keys: fp8
rows are keyed apart from bf16 rows, and a bf16 evaluator keeps the fingerprint it had before
precisions existed. The float8 conversion itself needs a GPU of compute capability 8.9 or newer
(``scripts/bench/bench_fp8.py`` runs it); these tests run on the CPU without torchao."""

import importlib.metadata
import json
import os

import numpy as np
import pytest
import torch
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model

from longppl.cache.key_token_cache import KeyTokenCache, cached_evaluator_scores, key_token_rows
from longppl.core.compilation import repeated_blocks
from longppl.core.scoring import EvaluatorScores
from longppl.metric.compute import compute_metric
from longppl.models import precision
from longppl.models.fingerprints import ModelIdentity
from longppl.settings import KeyTokenSettings, evaluator_compiles
from longppl.tools import compute_key_tokens

K, D = 47, 13
SETTINGS = KeyTokenSettings(K, D)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved tiny evaluator and evaluated model, and a JSONL corpus of two texts."""
    root = tmp_path_factory.mktemp("precision")
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    tiny_model("llama", len(ev_tok), seed=1).save_pretrained(root / "evaluator")
    ev_tok.save_pretrained(root / "evaluator")
    tiny_model("mistral", len(tok), seed=2).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    texts = [t[700 : 700 + size] for t, size in zip(govreport_texts()[3:5], (600, 400))]
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return dict(
        root=root, evaluator=str(root / "evaluator"), model=str(root / "model"), texts=texts, corpus=str(corpus)
    )


def compute(folders, **kwargs):
    args = dict(model_id=folders["model"], evaluator_model_id=folders["evaluator"], trunc_len=K, sliding_window=D)
    args.update(progress=False, **kwargs)
    return compute_metric(folders["texts"], **args)


def refusal(folders, **kwargs) -> str:
    """The one line ``compute`` refuses ``kwargs`` with."""
    with pytest.raises(ValueError) as err:
        compute(folders, **kwargs)
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.fixture
def gpu(monkeypatch):
    """Make torch report one CUDA GPU (``capability`` and ``name`` settable) without touching any: the
    precision checks run before a model is loaded, so nothing else reaches for the device."""
    state = dict(capability=(9, 0), name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: state["name"])
    return state


def installed_torchao(monkeypatch, version):
    """Make the distribution metadata say torchao ``version`` is installed (``None``: not installed)."""
    real = importlib.metadata.version

    def fake(name):
        if name != "torchao":
            return real(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", fake)


# ---- refusals, each one line, before anything is loaded ----


def test_fp8_on_the_cpu_is_refused(folders):
    message = refusal(folders, evaluator_precision="fp8", device="cpu")
    assert message.startswith("evaluator_precision='fp8' runs the evaluator's products on a CUDA GPU")
    assert "'cpu'" in message and "evaluator_precision='bf16'" in message


def test_fp8_on_a_gpu_without_float8_tensor_cores_is_refused(folders, gpu):
    gpu.update(capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    message = refusal(folders, evaluator_precision="fp8")
    assert "compute capability 8.9 or newer" in message and "cuda:0 (NVIDIA A100-SXM4-80GB) has 8.0" in message


def test_fp8_without_torchao_says_how_to_install_it(folders, gpu, monkeypatch):
    installed_torchao(monkeypatch, None)
    message = refusal(folders, evaluator_precision="fp8")
    assert "torchao, which is not installed" in message and 'pip install "longppl-hf[fp8]"' in message


def test_fp8_with_an_old_torchao_is_refused(folders, gpu, monkeypatch):
    installed_torchao(monkeypatch, "0.16.0+cu128")
    message = refusal(folders, evaluator_precision="fp8")
    assert f"needs torchao >= {precision.MIN_TORCHAO}" in message and "torchao 0.16.0+cu128 is installed" in message
    assert 'pip install -U "longppl-hf[fp8]"' in message


def test_a_recent_torchao_passes_the_checks(gpu, monkeypatch):
    for version in ("0.17.0", "0.18.0", "1.0.0.dev20260101"):
        installed_torchao(monkeypatch, version)
        assert precision.check_precision("fp8", "cuda", torch.bfloat16) == "fp8"


def test_an_accepted_fp8_evaluator_is_said_to_be_approximate_with_the_measured_agreement(gpu, monkeypatch):
    """fp8 passes its checks with a warning that carries what it did to a real evaluator's key tokens
    (the figures of docs/benchmarks.md, which this test reads back from the committed records)."""
    import json

    installed_torchao(monkeypatch, "0.18.0")
    with pytest.warns(UserWarning) as warned:
        precision.check_precision("fp8", "cuda", torch.bfloat16)
    (message,) = [str(w.message) for w in warned]
    assert message.startswith("evaluator_precision='fp8' is approximate: against float32 on real evaluators")
    results = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "records", "real_models", "results.json")
    with open(results, encoding="utf-8") as handle:
        rows = json.load(handle)["precision"]
    for model, length in (("smollm2-135m", 8192), ("gemma-3-270m", 32768)):
        measured = {r["precision"]: r for r in rows if r["model"] == model and r["length"] == length}
        for name in ("fp8", "bf16"):
            mean, low, high = measured[name]["jaccard"]
            assert f"{mean:.2f} [{low:.2f}, {high:.2f}]" in message, (model, name, message)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(torch_dtype="float32"), "converts a bfloat16 evaluator"),
        (dict(device="auto"), "with device 'auto'"),
        (dict(self_evaluation=True, evaluator_model_id=None), "but it got self_evaluation=True"),
        (dict(evaluator_precision="int8"), "evaluator_precision must be 'bf16', 'tf32' or 'fp8'"),
        (dict(torch_compile="yes"), "torch_compile must be True or False"),
    ],
)
def test_what_fp8_cannot_run_with_is_refused(folders, gpu, monkeypatch, kwargs, says):
    installed_torchao(monkeypatch, "0.18.0")
    assert says in refusal(folders, **{"evaluator_precision": "fp8", **kwargs})


def test_fp8_leaves_an_evaluator_object_as_it_is(folders):
    evaluator = tiny_model("llama", len(byte_level_bpe()), seed=1)
    message = refusal(
        folders,
        evaluator_model_id=None,
        evaluator_model=evaluator,
        evaluator_tokenizer=byte_level_bpe(),
        evaluator_precision="fp8",
    )
    assert "an evaluator object (converting it would change your model in place)" in message


def test_longppl_score_refuses_fp8_on_the_cpu_in_one_line(folders, tmp_path):
    from accelerate import PartialState

    argv = ["--corpus", folders["corpus"], "--evaluator", folders["evaluator"], "--output", str(tmp_path / "c")]
    try:
        with pytest.raises(SystemExit) as exit_info:
            compute_key_tokens.cli([*argv, "--evaluator-precision", "fp8", "--trunc-len", str(K)])
    finally:
        PartialState._reset_state()
    line = str(exit_info.value.code)
    assert (
        "\n" not in line and ": error: --evaluator-precision='fp8' runs the evaluator's products on a CUDA GPU" in line
    )
    assert not (tmp_path / "c").exists()  # refused before the cache folder was made


def test_longppl_score_parses_the_precision_and_the_compile_switch(folders, tmp_path):
    base = ["--corpus", folders["corpus"], "--evaluator", folders["evaluator"], "--output", str(tmp_path)]
    args = compute_key_tokens.parse_args(base)
    assert (args.evaluator_precision, args.torch_compile) == ("bf16", None)
    args = compute_key_tokens.parse_args([*base, "--evaluator_precision", "fp8", "--no-torch-compile"])
    assert (args.evaluator_precision, args.torch_compile) == ("fp8", False)
    assert compute_key_tokens.parse_args([*base, "--torch-compile"]).torch_compile is True
    with pytest.raises(SystemExit):
        compute_key_tokens.parse_args([*base, "--evaluator-precision", "fp16"])


# ---- compiled by default in fp8 only ----


def test_fp8_compiles_the_evaluator_unless_told_not_to():
    assert [evaluator_compiles(None, p) for p in ("bf16", "fp8")] == [False, True]
    assert [evaluator_compiles(False, p) for p in ("bf16", "fp8")] == [False, False]
    assert [evaluator_compiles(True, p) for p in ("bf16", "fp8")] == [True, True]


def test_bf16_by_default_scores_as_before(folders):
    """Left unset, the precision is bf16 and nothing is compiled: the values are those of an explicit
    ``evaluator_precision="bf16", torch_compile=False``, bit for bit."""
    default = compute(folders, alpha=0.005, beta=-50.0)
    explicit = compute(folders, alpha=0.005, beta=-50.0, evaluator_precision="bf16", torch_compile=False)
    assert default["longppls"] == explicit["longppls"] and default["perplexities"] == explicit["perplexities"]
    assert default["n_key_tokens"] == explicit["n_key_tokens"] and sum(default["n_key_tokens"]) > 0


# ---- what fp8 converts ----


def test_fp8_converts_the_linear_layers_of_the_blocks_only():
    model = tiny_model("llama", 300)
    names = sorted(precision.block_linears(repeated_blocks(model)))
    projections = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"] + [f"self_attn.{p}_proj" for p in "kvoq"]
    assert names == sorted(f"{layer}.{p}" for layer in range(2) for p in projections)
    head = model.get_output_embeddings()
    assert all(linear is not head for linear in precision.block_linears(repeated_blocks(model)).values())


def test_bf16_leaves_the_model_untouched():
    model = tiny_model("llama", 300)
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert precision.to_precision(model, "bf16") is model
    assert all(torch.equal(p, before[name]) and type(p) is torch.nn.Parameter for name, p in model.named_parameters())


def test_layers_torchao_cannot_take_are_refused_before_any_is_converted():
    # hidden 24: not a multiple of 16 (torchao's float8 products need it); the check names the layer
    odd = tiny_model("llama", 300, hidden_size=24).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"multiples of 16, but LlamaForCausalLM's block layer 0\.self_attn\.q_proj"):
        precision.to_precision(odd, "fp8")
    with pytest.raises(
        ValueError, match=r"converts bfloat16 weights, but LlamaForCausalLM's block layer .* is float32"
    ):
        precision.to_precision(tiny_model("llama", 300), "fp8")
    with pytest.raises(ValueError, match="lists no blocks"):
        precision.to_precision(torch.nn.Sequential(torch.nn.Linear(16, 16)), "fp8")


# ---- cache keys ----


def fixed_checkpoint(folder) -> str:
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        handle.write('{"model_type": "llama", "hidden_size": 32}\n')
    with open(os.path.join(folder, "tokenizer.json"), "w") as handle:
        handle.write('{"version": "1.0"}\n')
    with open(os.path.join(folder, "model.safetensors"), "wb") as handle:
        handle.write(bytes(range(256)) * 3)
    return str(folder)


def test_a_bf16_evaluator_keeps_the_fingerprint_it_had_before_precisions(tmp_path):
    # The fingerprint of this folder's bytes in bfloat16 as the code before evaluator precisions
    # computed it (fingerprints.py at 049f6c0): caches written then must keep being found.
    folder = fixed_checkpoint(tmp_path / "evaluator")
    before = "checkpoint:af194802e6a976cf8add4b9e6357a8dad87de1255086fde895f8c03d1458582c"
    identity = ModelIdentity.of_checkpoint(folder, torch.bfloat16)
    assert identity.fingerprint == before
    assert identity.with_precision("bf16") == identity


def test_fp8_is_another_evaluator_of_the_same_kind(tmp_path):
    checkpoint = ModelIdentity.of_checkpoint(fixed_checkpoint(tmp_path / "evaluator"), torch.bfloat16)
    weights = ModelIdentity.of_model(tiny_model("llama", 300), byte_level_bpe())
    for identity in (checkpoint, weights):
        fp8 = identity.with_precision("fp8")
        assert fp8.fingerprint != identity.fingerprint and fp8 == identity.with_precision("fp8")
        assert fp8.fingerprint.partition(":")[0] == identity.fingerprint.partition(":")[0]
        assert fp8.dtype == identity.dtype + "+fp8" and (fp8.name, fp8.revision) == (identity.name, identity.revision)


def synthetic_scores(texts, shift: float) -> list[EvaluatorScores]:
    scores = []
    for text in texts:
        n = len(text) // 4
        offsets = np.stack([np.arange(n) * 4, np.arange(n) * 4 + 4], axis=1)
        lp_long = np.linspace(-3.0, -0.1, n) + shift
        lp_short = np.where(np.arange(n) < K, np.nan, lp_long - 1.5)
        lp_long[0] = np.nan
        scores.append(EvaluatorScores(np.arange(n) % 200, offsets, lp_long, lp_short))
    return scores


def test_fp8_rows_and_bf16_rows_of_one_evaluator_never_mix(folders):
    texts = folders["texts"]
    bf16 = ModelIdentity.of_checkpoint(folders["evaluator"], torch.bfloat16)
    fp8 = bf16.with_precision("fp8")
    cache = KeyTokenCache(key_token_rows(texts, synthetic_scores(texts, 0.0), SETTINGS, bf16))
    assert cache.find(texts, SETTINGS, fp8.fingerprint) == [None, None]
    scored = []

    def score_missing(missing):
        scored.extend(missing)
        return fp8, synthetic_scores(missing, 0.25)

    got = cached_evaluator_scores(cache, texts, SETTINGS, fp8, score_missing, save=False)
    assert scored == texts  # the bf16 rows were not taken for fp8 ones
    assert all(np.allclose(g.lp_long[1:], w.lp_long[1:]) for g, w in zip(got, synthetic_scores(texts, 0.25)))
    again = cached_evaluator_scores(cache, texts, SETTINGS, bf16, None, save=False)  # and back: bf16's own
    assert all(np.allclose(g.lp_long[1:], w.lp_long[1:]) for g, w in zip(again, synthetic_scores(texts, 0.0)))
    dtypes = sorted(c["evaluator_dtype"] for c in cache.configurations())
    assert dtypes == ["bfloat16", "bfloat16+fp8"]


def test_longppl_score_in_fp8_finds_none_of_the_bf16_rows(folders, tmp_path, monkeypatch):
    """A cache that ``longppl score`` filled in bf16 holds nothing for the same evaluator in fp8 (the
    device checks, which refuse the CPU, are tested above and left out here)."""
    from accelerate import PartialState

    output = str(tmp_path / "cache")
    argv = ["--corpus", folders["corpus"], "--evaluator", folders["evaluator"], "--output", output]
    argv += ["--trunc-len", str(K), "--sliding-window", str(D)]
    try:
        assert compute_key_tokens.main(argv)["scored"] == 2
    finally:
        PartialState._reset_state()
    monkeypatch.setattr(precision, "check_precision", lambda value, *args: value)
    bf16_job = compute_key_tokens.ScoringJob(compute_key_tokens.parse_args(argv), "cpu")
    fp8_job = compute_key_tokens.ScoringJob(
        compute_key_tokens.parse_args([*argv, "--evaluator-precision", "fp8"]), "cpu"
    )
    assert bf16_job.identity == ModelIdentity.of_checkpoint(folders["evaluator"], torch.float32)
    assert bf16_job.missing(folders["texts"]) == []
    assert fp8_job.identity == bf16_job.identity.with_precision("fp8") and fp8_job.identity.dtype == "float32+fp8"
    assert fp8_job.missing(folders["texts"]) == folders["texts"]


# ---- checked once, at the surface, into a typed value ----


def test_a_precision_is_checked_once_into_a_member_that_travels_inward(folders, monkeypatch):
    """The metric turns the string it is given into an ``EvaluatorPrecision`` once; everything inward
    (the compile default, the conversion, the fingerprint) takes that member and checks no string
    again. Strings stay accepted at the public functions, with the same message for a wrong one."""
    from longppl.settings import EvaluatorPrecision

    assert EvaluatorPrecision.of("fp8") is EvaluatorPrecision.FP8 and EvaluatorPrecision.FP8 == "fp8"
    assert f"{EvaluatorPrecision.FP8}" == "fp8" and json.dumps(EvaluatorPrecision.BF16) == '"bf16"'
    for public in (
        lambda value: precision.check_precision(value, "cpu", torch.bfloat16),
        lambda value: precision.check_precision_request(value, None, None),
        lambda value: ModelIdentity("m", None, "bfloat16", "weights:0").with_precision(value),
    ):
        with pytest.raises(
            ValueError, match=r"^evaluator_precision must be 'bf16', 'tf32' or 'fp8' \(bf16: the exact "
        ):
            public("fp16")
    assert precision.check_precision("bf16", "cpu", torch.float32) is EvaluatorPrecision.BF16

    checked = []
    real = EvaluatorPrecision.of.__func__

    def counting(cls, value, name="evaluator_precision"):
        if not isinstance(value, EvaluatorPrecision):
            checked.append(value)  # a string checked: only the surface should
        return real(cls, value, name)

    monkeypatch.setattr(EvaluatorPrecision, "of", classmethod(counting))
    assert np.isfinite(compute(folders, alpha=0.005, beta=-50.0, evaluator_precision="bf16")["ppl"])
    assert checked == ["bf16"]


# ---- tf32: a float32 evaluator's products on TF32 tensor cores ----


def test_tf32_turns_tf32_products_on_for_the_evaluators_passes_only():
    """``to_precision(model, "tf32")`` marks a float32 model; every scoring pass of a marked model runs
    with PyTorch's two TF32 switches on, and puts them back after; an unmarked model's passes do not."""
    from longppl.core.logprobs import token_log_probs

    seen = {}

    def recorder(name):
        def record(*_):
            seen.setdefault(name, set()).add((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))

        return record

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        plain, marked = tiny_model("llama", 300, seed=3), tiny_model("llama", 300, seed=3)
        assert precision.to_precision(marked, "tf32") is marked
        ids = torch.randint(0, 300, (1, 40))
        for name, model in (("plain", plain), ("marked", marked)):
            model.model.layers[0].register_forward_pre_hook(recorder(name))
            token_log_probs(model, ids)
        assert seen == {"plain": {(False, False)}, "marked": {(True, True)}}
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_tf32_runs_a_float32_evaluator_and_refuses_other_weights():
    model = tiny_model("llama", 300).to(torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"^evaluator_precision='tf32' runs a float32 evaluator, but LlamaForCausalLM holds bfloat16"
    ):
        precision.to_precision(model, "tf32")
    assert precision.precision_dtype("tf32", None) == "float32"
    assert precision.precision_dtype("tf32", "auto") == "float32"
    assert precision.precision_dtype("tf32", "float32") == "float32"
    assert precision.precision_dtype("bf16", None) is None


def test_what_tf32_cannot_run_on_is_refused_in_one_line(folders, gpu):
    assert precision.check_precision("tf32", "cuda", torch.float32) == "tf32"
    assert precision.check_precision_request("tf32", "auto", None) == "tf32"
    with pytest.raises(ValueError, match=r"^evaluator_precision='tf32' runs the evaluator's products on a CUDA GPU"):
        precision.check_precision("tf32", "cpu", torch.float32)
    with pytest.raises(
        ValueError, match=r"^--evaluator-precision='tf32' runs a float32 evaluator .* loaded in bfloat16"
    ):
        precision.check_precision_request("tf32", None, "bfloat16", "--evaluator-precision")
    # the metric loads its evaluator in float32 for tf32 unless told another dtype, which it refuses
    assert "loaded in bfloat16: leave the dtype unset or pass float32" in refusal(
        folders, evaluator_precision="tf32", torch_dtype="bfloat16", device="cuda"
    )


def test_tf32_rows_are_another_evaluator_in_a_cache(tmp_path):
    identity = ModelIdentity("m", None, "float32", "weights:" + "0" * 64)
    tf32, fp8 = identity.with_precision("tf32"), identity.with_precision("fp8")
    assert len({identity.fingerprint, tf32.fingerprint, fp8.fingerprint}) == 3
    assert tf32.dtype == "float32+tf32"


def test_longppl_score_loads_a_tf32_evaluator_in_float32(folders, tmp_path):
    base = ["--corpus", folders["corpus"], "--evaluator", folders["evaluator"], "--output", str(tmp_path)]
    args = compute_key_tokens.parse_args([*base, "--evaluator-precision", "tf32"])
    assert args.evaluator_precision == "tf32"
    with pytest.raises(ValueError, match=r"^--evaluator-precision='tf32' runs the evaluator's products on a CUDA GPU"):
        compute_key_tokens.main([*base, "--evaluator-precision", "tf32", "--device", "cpu"])
