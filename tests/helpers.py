"""Local tokenizers, tiny models and real text for the tests (no network, CPU only)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "govreport_crs.jsonl")
SPECIALS = ["<s>", "</s>", "<pad>"]

#: The repository's root (the tests' own folder's parent).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: longce-train's tiny CPU recipe.
TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def read_recipe(path: str = TINY) -> dict:
    """A longce-train recipe (YAML) as a dict."""
    import yaml

    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def tiny_argv(tmp_path, *extra: str, subdir: str = "run") -> list[str]:
    """longce-train's arguments for the tiny recipe with the test's data path, output folder
    (``tmp_path/subdir``) and datasets cache, then ``extra``."""
    return [
        "--config",
        TINY,
        "--data_files",
        DATA,
        "--output_dir",
        str(tmp_path / subdir),
        "--cache_dir",
        str(tmp_path / "cache"),
        *extra,
    ]


@functools.cache
def govreport_texts() -> tuple[str, ...]:
    """The 13 public-domain CRS reports of tests/data (see its README)."""
    with open(DATA, encoding="utf-8") as handle:
        return tuple(json.loads(line)["text"] for line in handle if line.strip())


def write_books(folder) -> str:
    """``folder/validation.jsonl.gz`` and ``train.jsonl.gz``, each holding the CRS reports as books (a
    books folder as the reproduction reads it); returns ``folder`` as a string."""
    import gzip

    os.makedirs(folder, exist_ok=True)
    for name in ("validation", "train"):
        with gzip.open(os.path.join(folder, f"{name}.jsonl.gz"), "wt", encoding="utf-8") as f:
            for text in govreport_texts():
                f.write(json.dumps({"text": text}) + "\n")
    return str(folder)


def run_real_models_stage(study, stage: str, *extra: str) -> int:
    """``longppl_reproduce.real_models.cli``'s ``main`` for ``stage`` on a tiny study (``study.root``:
    the run folder is ``root/run``; ``study.books``: :func:`write_books`' folder; ``study.folders``:
    the tiny ``gemma`` and ``smollm2`` model folders), on the CPU at the smoke sizes (``--small``),
    with ``extra`` arguments; returns its exit status."""
    from longppl_reproduce.real_models.cli import main

    return main(
        [
            stage,
            "--run",
            str(study.root / "run"),
            "--books",
            study.books,
            "--gemma",
            study.folders["gemma"],
            "--smollm2",
            study.folders["smollm2"],
            "--device",
            "cpu",
            "--small",
            *extra,
        ]
    )


def _wrap(tok: Tokenizer, add_bos: bool) -> PreTrainedTokenizerFast:
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@functools.cache
def byte_level_bpe(vocab_size: int = 600, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """GPT-2 / Llama-3 style byte-level BPE trained on the reports (offsets include leading spaces)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(govreport_texts(), trainer)
    return _wrap(tok, add_bos)


@functools.cache
def metaspace_bpe(vocab_size: int = 900, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """SentencePiece-like BPE (Metaspace pre-tokenizer, byte fallback off) trained on the reports."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + ["<unk>"])
    tok.train_from_iterator(govreport_texts(), trainer)
    return _wrap(tok, add_bos)


class SlowByteTokenizer(PreTrainedTokenizer):
    """A Python (slow) tokenizer: one token per UTF-8 byte, no offset mapping.

    Multi-byte characters are split across tokens, which is what the decode-based offset fallback
    must get right.
    """

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        self._specials = {"<s>": 256, "</s>": 257, "<pad>": 258}
        kwargs.setdefault("bos_token", "<s>")
        kwargs.setdefault("eos_token", "</s>")
        kwargs.setdefault("pad_token", "<pad>")
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return 259

    def get_vocab(self):
        vocab = {f"<0x{i:02X}>": i for i in range(256)}
        vocab.update(self._specials)
        return vocab

    def _tokenize(self, text, **kwargs):
        return [f"<0x{b:02X}>" for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token):
        if token in self._specials:
            return self._specials[token]
        return int(token[3:5], 16)

    def _convert_id_to_token(self, index):
        for name, value in self._specials.items():
            if value == index:
                return name
        return f"<0x{index:02X}>"

    def convert_tokens_to_string(self, tokens):
        data = bytes(int(t[3:5], 16) for t in tokens if t not in self._specials)
        return data.decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return [self.bos_token_id] + token_ids_0 + ([] if token_ids_1 is None else token_ids_1)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()


def tiny_model(arch: str, vocab_size: int, seed: int = 0, max_positions: int = 8192, **overrides):
    """A random float32 causal LM of family ``arch`` small enough for CPU tests."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch == "llama":
        config = LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            **common,
        )
    elif arch == "mistral":
        config = MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            sliding_window=None,
            **common,
        )
    elif arch == "qwen2":
        config = Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            **common,
        )
    elif arch == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=max_positions, **common)
    elif arch == "gemma2":
        config = Gemma2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=max_positions,
            final_logit_softcapping=2.0,
            attn_logit_softcapping=50.0,
            sliding_window=max_positions,
            query_pre_attn_scalar=8,
            **common,
        )
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "gemma2":
        # Random init leaves logits small; scale the head so that soft-capping really bites.
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(40.0)
    return model.eval()


def model_and_evaluator() -> dict:
    """The metric's four model arguments: a tiny Qwen2 under the metaspace tokenizer, evaluated with
    a tiny Llama under the byte-level one (two tokenizers, so alignment is exercised)."""
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    return dict(
        model=tiny_model("qwen2", len(tok), seed=2),
        tokenizer=tok,
        evaluator_model=tiny_model("llama", len(ev_tok), seed=1),
        evaluator_tokenizer=ev_tok,
    )


@contextlib.contextmanager
def one_torch_thread():
    """Run the block on one torch intra-op thread, then restore the count. On two shared cores a
    second thread only waits on the other processes and makes tiny matmuls far slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def accelerate_launch_on_cpu(num_processes: int = 2) -> list[str]:
    """The command prefix that starts ``num_processes`` CPU processes with ``accelerate launch``
    (``--multi_gpu`` is accelerate's torchrun launcher; without GPUs the processes join over gloo),
    on a free local port; append the script and its arguments."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
            str(num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port)]  # fmt: skip


def json_leaves(value, where="results"):
    """Every number and null in a JSON value, with where it is (results.json writes NaN as null)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_leaves(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from json_leaves(item, f"{where}[{index}]")
    elif value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        yield where, value


def edited_config(source: str, directory, **changes) -> str:
    """The YAML config ``source`` with ``changes`` (dotted keys, e.g. ``training.steps``; missing parents
    are created) applied, written to ``directory/config.yaml``; returns that path."""
    import yaml

    with open(source, encoding="utf-8") as handle:
        config = yaml.safe_load(handle)
    for dotted, value in changes.items():
        target = config
        *parents, last = dotted.split(".")
        for key in parents:
            target = target.setdefault(key, {})
        target[last] = value
    path = os.path.join(str(directory), "config.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(yaml.safe_dump(config))
    return path


def one_step_args(cls, **overrides):
    """``cls`` (``TrainingArguments`` or ``LongCEConfig``) for the trainer tests: one CPU step of plain SGD
    at learning rate 1 (so an update equals minus the gradient), batches of 2, logs every step, nothing
    saved or reported; ``overrides`` replace or add fields."""
    settings = dict(
        output_dir="/tmp/longce-test",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        per_device_train_batch_size=2,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return cls(**settings)


def assert_same_cache(a: str, b: str) -> None:
    """The key-token caches in folders ``a`` and ``b`` (single folders or shards) have the same
    columns and rows, taken in the order of their keys (shards committed by several processes, or by
    a resumed run, list rows in commit order); the log-probability columns (``lp_*``) are compared as
    arrays, NaN equal to NaN."""
    import numpy as np

    from longppl.cache.key_token_cache import KeyTokenCache

    def by_key(path):
        dataset = KeyTokenCache.load(path).dataset
        keys = list(zip(dataset["text_fingerprint"], dataset["evaluator_fingerprint"], dataset["trunc_len"],
                        dataset["sliding_window"], dataset["add_special_tokens"], dataset["window_bos"]))  # fmt: skip
        assert len(set(keys)) == len(keys), f"{path} holds a key twice"
        return dataset.select(sorted(range(len(keys)), key=keys.__getitem__))

    a, b = by_key(a), by_key(b)
    assert a.column_names == b.column_names and len(a) == len(b)
    for name in a.column_names:
        if name.startswith("lp_"):
            for x, y in zip(a[name], b[name]):
                assert np.array_equal(np.array(x), np.array(y), equal_nan=True)
        else:
            assert a[name] == b[name], name


class ScriptedStub(torch.nn.Module):
    """A "model" whose greedy answer to the i-th prompt it is asked is ``answers[i]``."""

    def __init__(self, tokenizer, answers):
        super().__init__()
        self.tokenizer, self.answers = tokenizer, list(answers)

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = [self.tokenizer(self.answers.pop(0), add_special_tokens=False)["input_ids"] for _ in input_ids]
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


# ------------------------------------------------------------------ hang guards
#
# A test asserts behaviour, never speed. What a test waits on (a subprocess, a thread, a server) is
# guarded against a hang only, by a limit far above any run of the suite: on a loaded two-core machine
# the slowest subprocess took about ten minutes. Reaching the limit fails the test with a message that
# says it was the time, never a wrong result.

#: Seconds a test waits on one subprocess, thread or server before it calls that a hang.
HANG_GUARD_S = 3600.0


def hang(what: str, seconds: float, output: str | bytes | None = None):
    """Fail the test because ``what`` still ran after ``seconds`` (the hang guard), with the end of
    its ``output`` so far."""
    import pytest

    if isinstance(output, bytes):
        output = output.decode("utf-8", "replace")
    tail = f" Its last output: {output[-3000:]}" if output else ""
    pytest.fail(
        f"hang guard: {what} was still running after {seconds:g} s and was stopped. The test limits no speed: "
        f"this is a hang (or a machine far slower than any the suite has run on), not a wrong result.{tail}",
        pytrace=False,
    )


def _shown(command) -> str:
    return " ".join(map(str, command)) if isinstance(command, (list, tuple)) else str(command)


def run_guarded(command, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **kwargs)`` under the hang guard (``HANG_GUARD_S``): reaching it kills
    the process and fails the test saying so (:func:`hang`)."""
    try:
        return subprocess.run(command, timeout=HANG_GUARD_S, **kwargs)
    except subprocess.TimeoutExpired as err:
        hang(f"the command {_shown(command)}", HANG_GUARD_S, err.stderr or err.output)


def communicate_guarded(process: subprocess.Popen, input=None):
    """``process.communicate(input)`` under the hang guard: ``(stdout, stderr)``; a process still running
    at the guard is killed and the test fails saying so."""
    try:
        return process.communicate(input, timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        hang(f"the command {_shown(process.args)}", HANG_GUARD_S, err or out)


def wait_guarded(process: subprocess.Popen) -> int:
    """``process.wait()`` under the hang guard: its exit status; a process still running at the guard is
    killed and the test fails saying so."""
    try:
        return process.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        hang(f"the command {_shown(process.args)}", HANG_GUARD_S)


def join_guarded(worker) -> None:
    """``worker.join()`` (a thread or a ``multiprocessing`` process) under the hang guard: one still alive
    at the guard fails the test saying so (a process is killed first)."""
    worker.join(HANG_GUARD_S)
    if worker.is_alive():
        if hasattr(worker, "kill"):
            worker.kill()
            worker.join()
        hang(repr(worker), HANG_GUARD_S)


def run_while_locked(monkeypatch, path, work, fill):
    """``work()`` on a thread while this test holds ``longppl.atomic_files.directory_lock(path)`` as
    another process making the file would: checks that the thread asks for the lock and waits (still
    running 0.5 s later, with no result), then calls ``fill()`` (the other process's file) and lets
    the lock go. Returns ``work()``'s result; an exception raised in ``work`` is raised here."""
    import threading

    from longppl import atomic_files

    real, asked, results, failures = atomic_files.directory_lock, threading.Event(), [], []

    def noting(*args, **kwargs):  # the real lock, noting that the waiter found no file and asked for it
        asked.set()
        return real(*args, **kwargs)

    def target():
        try:
            results.append(work())
        except BaseException as err:  # noqa: BLE001 - raised again in the test's thread
            failures.append(err)

    monkeypatch.setattr(atomic_files, "directory_lock", noting)
    with real(str(path)):
        thread = threading.Thread(target=target)
        thread.start()
        assert asked.wait(60)
        thread.join(0.5)
        assert thread.is_alive() and not results and not failures  # waiting, not working
        fill()
    join_guarded(thread)
    if failures:
        raise failures[0]
    return results[0]


def plain_greedy(model, ids: list[int], steps: int, eos: set[int]) -> list[int]:
    """The argmax loop on one prompt alone (the whole prefix every step, no cache), stopping after a
    token of ``eos``: the reference of the greedy decoders' tests."""
    new = []
    with torch.no_grad():
        for _ in range(steps):
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
            if new[-1] in eos:
                break
    return new


def tiny_gemma3(layer_types, sliding_window=4, seed=0, vocab_size=64, max_positions=512):
    """A random float32 Gemma 3 text model with the given ``layer_types`` (``"sliding_attention"``,
    ``"full_attention"``), its window layers ``sliding_window`` tokens wide, in eval mode."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=list(layer_types),
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return Gemma3ForCausalLM(config).eval()


def windows_in_blocks(monkeypatch) -> list[int]:
    """The windows of every ``longppl.core.attention.blockwise_window_attention`` call from here on
    (the call still runs): a list the test reads to see which window layers ran in blocks."""
    import longppl.core.attention as attention

    windows, real = [], attention.blockwise_window_attention
    monkeypatch.setattr(attention, "blockwise_window_attention", lambda *a: windows.append(a[3]) or real(*a))
    return windows
