"""The Hub Space: the Gradio app (built, never launched), its requirements, and the push script."""

import configparser
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import gradio as gr
import huggingface_hub
import pytest
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model

import longppl
from longppl import register

K, D, ALPHA, BETA = 47, 13, 0.005, -50.0  # as test_metric: random tiny models have small LSDs


@pytest.fixture(scope="module")
def app():
    from longppl import app as space_app

    return space_app


@pytest.fixture(scope="module")
def push_script(repo_root):
    spec = importlib.util.spec_from_file_location("push_metric_to_hub", os.path.join(repo_root, "scripts", "push_metric_to_hub.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny evaluator and evaluated model saved as local folders (they stand in for Hub ids)."""
    root = tmp_path_factory.mktemp("models")
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    for name, model, tokenizer in (("evaluator", tiny_model("llama", len(ev_tok), seed=1), ev_tok),
                                   ("model", tiny_model("mistral", len(tok), seed=2), tok)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "model"), str(root / "evaluator")


def test_blocks_build_without_loading_models(app, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("building the UI must not load a model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(app, "_metric", None)
    demo = app.build_demo()
    assert isinstance(demo, gr.Blocks) and app._metric is None
    (handler,) = [fn for fn in demo.fns.values() if fn.fn is app.score]
    labels = [block.label for block in handler.inputs]
    assert labels[1:] == ["Evaluated model (Hub id)", "Evaluator model (Hub id)", "K (short-context length)",
                          "d (sliding window)", "alpha (LSD threshold)", "beta (LCL threshold)"]
    assert [block.label for block in handler.outputs[:3]] == ["LongPPL", "PPL", "Key tokens"]
    defaults = {block.label: block.value for block in handler.inputs}
    assert (defaults["K (short-context length)"], defaults["d (sliding window)"]) == (4096, 1024)
    assert (defaults["alpha (LSD threshold)"], defaults["beta (LCL threshold)"]) == (2.0, -2.0)


def test_compute_button_gives_the_metric_values_and_key_tokens(app, model_dirs):
    model, evaluator = model_dirs
    texts = [govreport_texts()[0][1000:1900], govreport_texts()[1][1000:2400]]
    longppl_value, ppl, segments, table = app.score(
        f"{texts[0]}\n{app.SEPARATOR}\n{texts[1]}\n", model, evaluator, K, D, ALPHA, BETA
    )
    expected = app.load_metric().compute(
        predictions=texts, model_id=model, evaluator_model_id=evaluator, trunc_len=K, sliding_window=D,
        alpha=ALPHA, beta=BETA, return_key_spans=True, progress=False,
    )
    assert longppl_value == pytest.approx(expected["longppl"], abs=1e-4)
    assert ppl == pytest.approx(expected["ppl"], abs=1e-4)
    shown = "".join(piece for piece, _ in segments)
    assert shown == f"{texts[0]}\n\n{app.SEPARATOR}\n\n{texts[1]}"
    keys = [piece for piece, label in segments if label == app.KEY_LABEL]
    spans = [texts[i][a:b] for i in range(2) for a, b in expected["key_spans"][i]]
    assert keys == spans and len(keys) > 0
    assert f"| 2 | {expected['longppls'][1]:.3f} | {expected['perplexities'][1]:.3f} |" in table


@pytest.mark.parametrize(
    "texts, model_id, trunc_len, message",
    [
        ("  \n---\n  ", "m", K, "Paste at least one long text"),
        ("some text", " ", K, "Give the model's Hub id"),
        ("some text", "m", 0, "trunc_len must be an integer >= 1"),
    ],
)
def test_bad_input_is_shown_in_the_ui(app, model_dirs, texts, model_id, trunc_len, message):
    model, evaluator = model_dirs
    with pytest.raises(gr.Error, match=message):
        app.score(texts, model if model_id == "m" else model_id, evaluator, trunc_len, D, ALPHA, BETA)


def test_split_texts(app):
    assert app.split_texts("a\nb\n---\n\nc\n ---  \n\n---\n") == ["a\nb", "c"]
    assert app.split_texts("one --- line") == ["one --- line"]


def _setup_cfg(repo_root):
    config = configparser.ConfigParser()
    config.read(os.path.join(repo_root, "setup.cfg"))
    return config


def test_space_requirements(repo_root):
    """requirements.txt pins what the package pins, for every library the shipped code imports.

    A library of an optional extra (matplotlib for ``figures.py``) may be imported inside a function
    only, where its absence is a clear error when that function is used, not when the module loads.
    """
    required = [line.strip() for line in open(os.path.join(longppl.METRIC_PATH, "requirements.txt")) if line.strip()]
    config = _setup_cfg(repo_root)
    install_requires = config["options"]["install_requires"].split()
    assert set(required) <= set(install_requires)
    names = {re.split(r"[<>=!~ ]", line)[0].lower() for line in required}
    extras = {re.split(r"[<>=!~ \[]", line.strip())[0].lower()
              for name, value in config["options.extras_require"].items() if name != "test"
              for line in value.splitlines() if line.strip() and not line.strip().startswith("#")}
    distributions = importlib.metadata.packages_distributions()
    top_level, in_functions = set(), set()
    for name in os.listdir(longppl.METRIC_PATH):
        if name.endswith(".py") and name != "app.py":  # gradio comes with the Space's sdk
            source = open(os.path.join(longppl.METRIC_PATH, name), encoding="utf-8").read()
            statement = r"(?:import\s+([A-Za-z_]\w*)|from\s+([A-Za-z_]\w*)(?:\.\w+)*\s+import\b)"
            top_level |= {a or b for a, b in re.findall("^" + statement, source, re.M)}
            in_functions |= {a or b for a, b in re.findall(r"^\s+" + statement, source, re.M)}
    ours = set(sys.stdlib_module_names) | {"__future__", "longppl"}
    for module in sorted(top_level - ours):
        assert {d.lower() for d in distributions[module]} & names, f"{module} is imported but not in requirements.txt"
    for module in sorted(in_functions - top_level - ours):
        assert {d.lower() for d in distributions[module]} & (names | extras), f"{module} is in no requirement or extra"


def test_gradio_is_a_test_dependency(repo_root):
    test_extra = _setup_cfg(repo_root)["options.extras_require"]["test"].split()
    assert f"gradio=={gr.__version__}" in test_extra  # the version the card's sdk_version names


def test_dry_run_lists_the_folder_as_tracked(push_script, repo_root, capsys):
    push_script.main(["--repo-id", "my-org/longppl", "--dry-run"])
    listed = capsys.readouterr().out.split()
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "metrics/longppl"],
        cwd=repo_root, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert listed == sorted(os.path.relpath(p, "metrics/longppl") for p in tracked)
    essential = {"README.md", "app.py", "requirements.txt"} | {os.path.basename(p) for p in register.module_files()}
    assert essential <= set(listed)


def test_dry_run_leaves_out_caches_and_hidden_files(push_script, tmp_path, capsys):
    folder = tmp_path / "longppl"
    shutil.copytree(longppl.METRIC_PATH, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "longppl.cpython-311.pyc").write_bytes(b"\0")
    (folder / ".DS_Store").write_bytes(b"\0")
    (folder / "stray.pyc").write_bytes(b"\0")
    push_script.main(["--repo-id", "my-org/longppl", "--dry-run", "--folder", str(folder)])
    listed = capsys.readouterr().out.split()
    assert listed == sorted(name for name in os.listdir(longppl.METRIC_PATH) if name != "__pycache__")
    assert not [name for name in listed if "pycache" in name or name.startswith(".") or name.endswith(".pyc")]


class RecordingApi:
    calls = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        return "https://huggingface.co/spaces/my-org/longppl/commit/abc"


@pytest.fixture
def recording_api(monkeypatch):
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    return RecordingApi.calls


def test_push_creates_a_gradio_space_and_uploads_exactly_the_listed_files(push_script, recording_api, capsys):
    push_script.main(["--repo-id", "my-org/longppl", "--token", "hf_test"])
    assert recording_api[0] == ("init", "hf_test")
    assert recording_api[1] == ("create_repo", "my-org/longppl",
                                dict(repo_type="space", space_sdk="gradio", exist_ok=True, private=False))
    upload = recording_api[2][1]
    assert upload["repo_id"] == "my-org/longppl" and upload["repo_type"] == "space"
    assert upload["folder_path"] == push_script.METRIC_FOLDER
    assert upload["allow_patterns"] == push_script.space_files()
    assert "huggingface.co/spaces/my-org/longppl" in capsys.readouterr().out


def test_push_without_a_token_fails_before_any_upload(push_script, recording_api, monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(SystemExit) as exit_info:
        push_script.main(["--repo-id", "my-org/longppl"])
    message = str(exit_info.value.code)
    assert "No Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login`" in message
    assert recording_api == []


@pytest.mark.parametrize("repo_id", ["longppl", "my-org/longppl/extra", "my-org/", "/longppl", "-org/longppl",
                                     "my-org/long ppl", "my-org/long--ppl", "my-org/longppl.."])
def test_push_refuses_a_repo_id_that_is_not_owner_name(push_script, recording_api, repo_id):
    with pytest.raises(SystemExit) as exit_info:
        push_script.main([f"--repo-id={repo_id}", "--token", "hf_test"])
    message = str(exit_info.value.code)
    assert f"--repo-id {repo_id!r} is not a Space id" in message and "Pass owner/name" in message
    assert recording_api == []


def test_app_runs_from_a_copy_of_the_space_folder(push_script, tmp_path):
    """The Space is the uploaded files alone, in a folder not named longppl, with no package installed."""
    space = tmp_path / "space"
    space.mkdir()
    for name in push_script.space_files():
        shutil.copyfile(os.path.join(longppl.METRIC_PATH, name), space / name)
    spec = importlib.util.spec_from_file_location("space_app", space / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    metric = module.load_metric()
    assert type(metric).__name__ == "LongPPL" and isinstance(module.demo, gr.Blocks)
    assert "return_key_spans" in metric.inputs_description
