"""LongPPL against long-context ability over a population of context extensions (the second attempt).

    python scripts/reproduce_longppl.py --config configs/reproduce/population_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro2/

A base model B is trained from scratch at a short context, then extended to the evaluation length
``L`` by several methods (PI, NTK-aware, YaRN, ABF, EABF), each fine-tuned for several step counts:
the population differs in long-context ability while its short-context training is shared.
Evaluators (E1, optionally E2, ...) are trained apart, at ``L``, and are not members. Each evaluator
calibrates its own alpha before any member is scored; the analysis plan (exclusions, statistics) is
in the config: ``analysis.plan`` ``second`` (this module's report) or ``third`` (the third attempt's,
``longppl_reproduce.third_attempt``: format-only exclusion, a composite of lines, needle and the
two-hop task of ``longppl_reproduce.two_hop``, clusters = configurations, a decision rule).

Stages (``--stages``, comma separated, or ``all``), each resumable: every file is written
atomically and a stage skips what its files say is done, so a run can be split into short calls
(a model counts as trained when its training record and its files are all there: one whose weights
were deleted or cut off is trained again). A record that is not JSON or not of its shape stops the
run with one line naming it (delete it, and its stage computes it again).

- ``tokenizer``: byte-level BPE on the first ``data.tokenizer_books`` books -> ``tokenizer/``.
- ``data``: ``data/train_tokens.npy`` (training books, one stream); ``data/validation.jsonl``
  (documents of ``L`` tokens from the validation books' bodies) and ``data/null.jsonl`` (the same
  with all but their last ``data.null_keep`` tokens taken from another book); task-document pools
  ``data/pools/<kind>-<seq_len>-<within>.npz``; test cases ``data/cases/`` (lines at the gate
  lengths, lines beyond K per length, needle, answer tokens).
- ``base``: B -> ``models/<base>/``, then its gate (lines accuracy at ``gate.length``) ->
  ``eval/gates/<base>.json``; a failed gate stops the run with a message (and is recorded).
- ``evaluators``: every enabled evaluator (``--evaluators`` selects) likewise.
- ``members``: every member (``--members`` / ``--shard i/n`` select) -> ``models/members/<name>/``:
  B extended, then fine-tuned for its steps with its own seed (0 steps: the extension alone).
- ``calibrate``: per evaluator (``--evaluators`` selects), its key-token caches (``longppl-score``) of
  the real and the null documents -> ``caches/``; alpha from the tokens past ``L - K`` ->
  ``eval/calibration.json`` (the first evaluator) or ``eval/calibration-<name>.json``; the first
  evaluator's secondary-window cache too, so that ``evaluate`` only reads caches.
- ``evaluate``: per member -> ``eval/members/<name>.json``: lines accuracy per length (asked line
  beyond K), at the gate length, needle accuracy, two-hop accuracy (when
  ``evaluation.two_hop_length`` is set), the answer's log-likelihood, and PPL / LongPPL
  against every evaluator cache (primary and secondary windows, soft, the alpha x beta grid), with
  per-document sums for bootstraps. Members are scored in this process with the library's scoring
  functions (``longppl.core.scoring``, what ``longppl-evaluate`` runs): EABF members need their attention
  function registered in the process that loads them.
- ``answer_tokens``: Figure 5(b) on E1 -> ``eval/answer_tokens.json``.
- ``report``: ``results.json``, ``report.md``, ``figures/``.
- ``export``: B and E1 in bf16, shards of at most 15 MB, into ``--export-dir``.

Processes side by side (one per GPU) share the members with ``--claim <id>`` (one id per call): each
member is trained / evaluated by the first process to claim it (``claims/<id>/``).

Wall times per stage and per model are summed over calls in ``timings.json``; every seed is in
``results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from fractions import Fraction

from longppl.tools.cli import command_line, run_command, tool_parser

from .books import read_books
from .config import Population, Pretrained, Window, folder_name, read_population
from .report_text import closing_sections, fmt
from .run_folder import RunFolder, finite, read_record

STAGES = (
    "tokenizer",
    "data",
    "base",
    "evaluators",
    "members",
    "calibrate",
    "evaluate",
    "answer_tokens",
    "report",
    "export",
)


# ------------------------------------------------------------------ shared helpers


def device_of(config: Population) -> str:
    import torch

    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


def load_tokenizer(run: RunFolder):
    from transformers import AutoTokenizer

    if not run.has("tokenizer", "tokenizer.json"):
        raise ValueError(f"No tokenizer in {run.path('tokenizer')}: run the 'tokenizer' stage first.")
    return AutoTokenizer.from_pretrained(os.path.dirname(run.path("tokenizer", "tokenizer.json")))


def books(config: Population) -> tuple[list[str], list[str]]:
    """``(training books, validation books)``: the validation corpus, else the last
    ``data.validation_books`` of the corpus (held out of training)."""
    train = read_books(config.corpus, config.text_column)
    if config.data.max_books:
        train = train[: config.data.max_books]
    if config.validation_corpus:
        return train, read_books(config.validation_corpus, config.text_column)
    held = config.data.validation_books
    if len(train) <= held:
        raise ValueError(
            f"The corpus {config.corpus!r} holds {len(train)} books; holding out data.validation_books = {held} "
            "leaves none to train on: give --validation-corpus or a larger corpus."
        )
    return train[:-held], train[-held:]


def validation_books(config: Population) -> list[str]:
    """The validation books of :func:`books`, without reading the training corpus when a validation
    corpus is given (the needle cases and the null documents need only these)."""
    if config.validation_corpus:
        return read_books(config.validation_corpus, config.text_column)
    return books(config)[1]


def book_ids(tokenizer, texts: list[str]) -> list:
    """Each text's token ids (no special tokens) as a NumPy array."""
    import numpy as np

    from .family import token_dtype

    dtype = token_dtype(len(tokenizer))
    return [np.asarray(ids, dtype=dtype) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def write_jsonl(path: str, records: list[dict]) -> None:
    from longppl.atomic_files import write_file_atomically

    write_file_atomically(path, lambda handle: handle.writelines(json.dumps(r) + "\n" for r in records))


def read_texts(path: str) -> list[str]:
    """The texts of a JSONL file this run wrote (``write_jsonl``), a bad line named by its file and line."""
    from longppl.tools.corpus import jsonl_records

    return [record["text"] for _, record in jsonl_records(path, ("text",), f"delete {path} and run again.")]


def pool_name(kind: str, seq_len: int, within: int | None) -> str:
    return f"{kind}-{seq_len}-{within or 'all'}.npz"


def training_runs(config: Population) -> list[tuple[int, object]]:
    """``(seq_len, mix)`` of every model that trains on task documents (their pools are built by ``data``)."""
    pretrained = [config.base, *(e for e in config.evaluators if e.enabled)]
    return [(p.training.seq_len, p.mix) for p in pretrained] + [(config.finetune.training.seq_len, config.finetune.mix)]


# ------------------------------------------------------------------ tokenizer and data


def stage_tokenizer(config: Population, run: RunFolder, members=None) -> None:
    from .family import train_tokenizer

    if run.has("tokenizer", "tokenizer.json"):
        run.log("tokenizer: exists, kept")
        return
    from longppl.atomic_files import replace_directory_atomically

    train, _ = books(config)
    sample = train[: config.data.tokenizer_books]
    tokenizer = train_tokenizer(sample, config.data.vocab_size)
    tokens = sum(len(ids) for ids in tokenizer(sample, add_special_tokens=False)["input_ids"])
    info = {"vocab_size": len(tokenizer), "books": len(sample), "chars_per_token": sum(map(len, sample)) / tokens}

    def write(tmp: str) -> None:
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "tokenizer_info.json"), "w", encoding="utf-8") as handle:
            json.dump(info, handle, indent=1)

    replace_directory_atomically(os.path.dirname(run.path("tokenizer", "x")), write)
    run.log(f"tokenizer: {len(tokenizer)} tokens from {len(sample)} books")


def stage_data(config: Population, run: RunFolder, members=None) -> None:
    from .family import encode_stream, save_token_array

    tokenizer = load_tokenizer(run)
    train = validation = None
    if not run.has("data", "train_tokens.npy"):
        train, validation = books(config)
        stream = encode_stream(tokenizer, train)
        save_token_array(run.path("data", "train_tokens.npy"), stream)
        run.log(f"data: {len(train)} training books, {stream.shape[0]:,} tokens")
    if not run.has("data", "null.jsonl"):
        if validation is None:
            validation = validation_books(config)
        write_documents(config, run, tokenizer, book_ids(tokenizer, validation))
    run_data_jobs(config, run, data_jobs(config, run))
    run.log("data: test cases written")


def data_jobs(config: Population, run: RunFolder) -> list[tuple]:
    """The task-document pools and test-case files still to write, as ``(kind, *arguments)``: each
    one is independent, seeded by its own arguments, and written atomically to its own file."""
    jobs = []
    for seq_len, mix in training_runs(config):
        for kind in mix.task_shares():
            if not run.has("data", "pools", pool_name(kind, seq_len, mix.asked_within)):
                jobs.append(("pool", kind, seq_len, mix.asked_within))
    lengths = set()
    for spec in gate_specs(config):  # one file a length: evaluators of one length share it
        if spec.gate.length not in lengths and not run.has("data", "cases", f"gate-{spec.gate.length}.jsonl"):
            jobs.append(("gate", spec.name))
        lengths.add(spec.gate.length)
    for length in config.evaluation.lines_lengths:
        if not run.has("data", "cases", f"lines-{length}.jsonl"):
            jobs.append(("lines", length))
    if not run.has("data", "cases", "needle.jsonl"):
        jobs.append(("needle",))
    if config.evaluation.two_hop_length and not run.has("data", "cases", "two_hop.jsonl"):
        jobs.append(("two_hop",))
    if not run.has("data", "cases", "answer_tokens.jsonl"):
        jobs.append(("answer_tokens",))
    return jobs


def run_data_jobs(config: Population, run: RunFolder, jobs: list[tuple]) -> None:
    """Run ``jobs`` (:func:`data_jobs`) in worker processes, one per CPU core at most: generating
    cases and documents is tokenizer-bound Python, minutes for one process on the H200 config. The
    files do not depend on the order the jobs run in (each job seeds its own generator)."""
    import concurrent.futures
    import multiprocessing

    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            run_data_job(config, run.root, job)
        return
    # spawn, not fork: the parent holds a Rust tokenizer and may hold CUDA state
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for message in pool.map(run_data_job, [config] * len(jobs), [run.root] * len(jobs), jobs):
            run.log(message)


def run_data_job(config: Population, root: str, job: tuple) -> str:
    """Write one pool or case file of :func:`data_jobs` into the run folder at ``root``; returns the
    line to log."""
    import numpy as np

    run = RunFolder(root, log=lambda *_: None)
    tokenizer = load_tokenizer(run)
    kind, arguments = job[0], job[1:]
    if kind == "pool":
        stream = np.load(run.path("data", "train_tokens.npy"), mmap_mode="r", allow_pickle=False)
        return write_pool(config, run, tokenizer, stream, *arguments)
    if kind == "gate":
        spec = next(spec for spec in gate_specs(config) if spec.name == arguments[0])
        return write_gate_cases(config, run, tokenizer, spec)
    if kind == "lines":
        return write_lines_cases_beyond(config, run, tokenizer, *arguments)
    if kind == "needle":
        return write_needle_cases(config, run, tokenizer)
    if kind == "two_hop":
        return write_two_hop_cases(config, run, tokenizer)
    return write_answer_token_cases(config, run, tokenizer)


def write_documents(config: Population, run: RunFolder, tokenizer, validation_ids: list) -> None:
    """Validation documents of ``L`` tokens from the books' bodies, and their null twins."""
    from . import corpus_chunks

    data = config.data
    documents = corpus_chunks.body_chunks(
        validation_ids,
        data.length,
        data.validation_documents,
        skip_fraction=data.skip_fraction,
        per_book_cap=data.per_book_cap,
        seed=config.seed,
    )
    book_of_row = books_of_rows(documents, validation_ids)
    null = corpus_chunks.null_documents(documents, validation_ids, data.null_keep, config.seed, book_of_row)
    as_text = tokenizer.batch_decode
    write_jsonl(run.path("data", "validation.jsonl"), [{"text": t} for t in as_text(documents.tolist())])
    write_jsonl(run.path("data", "null.jsonl"), [{"text": t} for t in as_text(null.tolist())])
    run.log(f"data: {len(documents)} validation documents of {data.length} tokens, and as many null documents")


def books_of_rows(documents, books_ids: list) -> list[int]:
    """The book each row of ``documents`` was cut from (the first book holding it), so that a null
    document's head comes from another book."""

    def holds(ids, needle: bytes) -> bool:  # at a token boundary, not a byte shifted
        haystack, at = ids.tobytes(), -1
        while (at := haystack.find(needle, at + 1)) >= 0:
            if at % ids.itemsize == 0:
                return True
        return False

    found = []
    for row in documents:
        needle = row.astype(books_ids[0].dtype).tobytes()
        book = next((b for b, ids in enumerate(books_ids) if holds(ids, needle)), None)
        if book is None:  # body_chunks cuts every row from one book: not reached
            raise ValueError("A validation document is in no validation book.")
        found.append(book)
    return found


def write_pool(config: Population, run: RunFolder, tokenizer, stream, kind: str, seq_len: int, within) -> str:
    """``data.task_documents`` training documents of ``kind`` (lines or needle) for ``seq_len``."""
    import numpy as np

    from . import lines, needle, two_hop
    from .family import save_ragged, token_dtype

    name = pool_name(kind, seq_len, within)
    rng = np.random.default_rng([config.seed, seq_len, within or 0, {"lines": 0, "needle": 1, "two_hop": 2}[kind]])
    if kind == "two_hop":
        most = max(config.data.lines_min + 1, int(0.8 * lines.lines_for_token_length(tokenizer, seq_len)))
        documents = [
            two_hop.fitted_two_hop_document(
                tokenizer,
                rng,
                seq_len,
                min_lines=config.data.lines_min,
                max_lines=most,
                share=config.evaluation.two_hop_share,
            )
            for _ in range(config.data.task_documents)
        ]
    elif kind == "lines":
        # Records of up to ~60% of the sequence, so the rest is questions (many retrieval targets).
        most = max(config.data.lines_min, int(0.6 * lines.lines_for_token_length(tokenizer, seq_len)))
        documents = [
            lines.fitted_lines_document(
                tokenizer, rng, seq_len, min_lines=config.data.lines_min, max_lines=most, asked_within=within
            )
            for _ in range(config.data.task_documents)
        ]
    else:
        documents = [
            needle.needle_training_document(
                tokenizer, stream, seq_len, rng, needles=config.data.needles, asked_within=within
            )
            for _ in range(config.data.task_documents)
        ]
    arrays = [np.asarray(d) for d in documents]
    save_ragged(run.path("data", "pools", name), arrays, token_dtype(len(tokenizer)))
    return f"data: {len(arrays)} {kind} documents for seq_len {seq_len} (asked within {within or 'any'})"


def gate_specs(config: Population) -> list[Pretrained]:
    return [config.base, *(e for e in config.evaluators if e.enabled)]


def write_gate_cases(config: Population, run: RunFolder, tokenizer, spec: Pretrained) -> str:
    """Lines cases at a gate's length, the asked line uniform over the record."""
    from . import lines

    evaluation, seed = config.evaluation, config.seed
    # The greedy answer follows the prompt inside the model's positions.
    target = spec.gate.length - evaluation.max_new_tokens
    num_lines = lines.lines_for_token_length(tokenizer, target, seed=seed)
    cases = lines.generate_lines_cases(num_lines, spec.gate.cases, seed + spec.gate.length)
    lines.write_lines_cases(run.path("data", "cases", f"gate-{spec.gate.length}.jsonl"), cases)
    return f"data: {len(cases)} gate cases of {num_lines} lines for {spec.name}"


def write_lines_cases_beyond(config: Population, run: RunFolder, tokenizer, length: int) -> str:
    """Lines cases of ``length`` tokens whose asked line lies more than K tokens before the question."""
    from . import lines

    evaluation = config.evaluation
    cases = lines.lines_cases_beyond(tokenizer, length, evaluation.cases, evaluation.beyond, config.seed + length)
    lines.write_lines_cases(run.path("data", "cases", f"lines-{length}.jsonl"), cases)
    return f"data: {len(cases)} lines cases of {length} tokens, asked beyond {evaluation.beyond}"


def write_needle_cases(config: Population, run: RunFolder, tokenizer) -> str:
    """Needle cases in the validation books, the asked needle more than K tokens before the question."""
    import numpy as np

    from . import needle

    evaluation = config.evaluation
    validation = validation_books(config)
    cases = needle.make_needle_cases(
        tokenizer,
        np.concatenate(book_ids(tokenizer, validation)),
        evaluation.needle_length,
        evaluation.cases,
        needles=config.data.needles,
        beyond=evaluation.beyond,
        seed=config.seed,
    )
    needle.write_needle_cases(run.path("data", "cases", "needle.jsonl"), cases)
    return f"data: {len(cases)} needle cases of {evaluation.needle_length} tokens"


def write_two_hop_cases(config: Population, run: RunFolder, tokenizer) -> str:
    """Two-hop cases (``two_hop``): the asked pointer line and the line it names both more than K
    tokens before the question."""
    from . import lines, two_hop

    evaluation = config.evaluation
    cases = two_hop.two_hop_cases_beyond(
        tokenizer,
        evaluation.two_hop_length,
        evaluation.cases,
        evaluation.beyond,
        config.seed + 2,
        evaluation.two_hop_share,
    )
    lines.write_lines_cases(run.path("data", "cases", "two_hop.jsonl"), cases)
    return (
        f"data: {len(cases)} two-hop cases of {evaluation.two_hop_length} tokens, both hops beyond {evaluation.beyond}"
    )


def write_answer_token_cases(config: Population, run: RunFolder, tokenizer) -> str:
    """The answer-token (Figure 5(b)) cases: the asked line beyond the primary short window."""
    from . import lines

    spec = config.answer_tokens
    beyond = config.scoring.primary.trunc_len
    cases = lines.lines_cases_beyond(tokenizer, spec.length, spec.cases, beyond, config.seed + 1)
    lines.write_lines_cases(run.path("data", "cases", "answer_tokens.jsonl"), cases)
    return f"data: {len(cases)} answer-token cases of {spec.length} tokens"


# ------------------------------------------------------------------ training


def pool(run: RunFolder, kind: str, seq_len: int, within):
    from .family import load_ragged

    name = pool_name(kind, seq_len, within)
    if not run.has("data", "pools", name):
        raise ValueError(f"No {kind} documents at {run.path('data', 'pools', name)}: run the 'data' stage first.")
    return load_ragged(run.path("data", "pools", name))


def batches(run: RunFolder, seq_len: int, mix, seed: int):
    """The training batches of a model: book windows with task documents of ``mix``."""
    import numpy as np

    from .family import TrainingBatches

    if not run.has("data", "train_tokens.npy"):
        raise ValueError(f"No training tokens in {run.path('data')}: run the 'data' stage first.")
    stream = np.load(run.path("data", "train_tokens.npy"), allow_pickle=False)
    tasks = {kind: (pool(run, kind, seq_len, mix.asked_within), share) for kind, share in mix.task_shares().items()}
    return TrainingBatches(stream, [], seq_len, 0.0, [seed, 1], tasks=tasks)


def model_folder(run: RunFolder, name: str) -> str:
    return os.path.dirname(run.path("models", name, "x"))


def member_folder(run: RunFolder, name: str) -> str:
    return os.path.dirname(run.path("models", "members", name, "x"))


def pretrain(config: Population, run: RunFolder, spec: Pretrained) -> None:
    """Train ``spec`` from scratch (skipped when trained), then check its gate."""
    from .family import Variant, is_trained, train_variant

    folder = model_folder(run, spec.name)
    if is_trained(folder):
        run.log(f"{spec.name}: trained, kept")
    else:
        tokenizer = load_tokenizer(run)
        variant = Variant(spec.name, spec.shape.model_fields(), spec.training.settings(spec.seed))
        with run.timed("train", spec.name):
            train_variant(
                variant,
                tokenizer,
                batches(run, spec.training.seq_len, spec.mix, spec.seed),
                folder,
                device_of(config),
                run.log,
            )
    check_gate(config, run, spec)


def load_member(folder: str, device: str):
    """``(model, tokenizer)`` of a saved model (a member with EABF gets its attention function)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .family import TRAINING_RECORD

    record = read_record(os.path.join(folder, TRAINING_RECORD))
    attention = "sdpa"
    extension = record["model"].get("extension") if isinstance(record.get("model"), dict) else None
    if extension and extension["method"] == "eabf":
        from longce.context_extension import register_eabf_attention

        attention = register_eabf_attention(extension["eabf_base_length"])
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention).to(device)
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


def lines_result(model, tokenizer, cases, config: Population, score=None) -> dict:
    """Accuracy (LongChat's rule) of ``cases`` by ``score`` (default ``lines.lines_accuracy``), with
    the number of outputs holding no number."""
    from . import lines

    found = (score or lines.lines_accuracy)(
        model,
        tokenizer,
        cases,
        max_new_tokens=config.evaluation.max_new_tokens,
        batch_size=config.evaluation.batch_size,
    )
    return {
        "accuracy": found["accuracy"],
        "correct": found["correct"],
        "total": found["total"],
        "no_number": sum(not has for has in found["has_number"]),
        "outputs": found["outputs"],
    }


def read_cases(run: RunFolder, name: str):
    from . import lines

    if not run.has("data", "cases", name):
        raise ValueError(f"No test cases at {run.path('data', 'cases', name)}: run the 'data' stage first.")
    return lines.read_lines_cases(run.path("data", "cases", name))


def read_benchmark_cases(config: Population, run: RunFolder, with_needle: bool = True) -> dict:
    """The test cases of every benchmark a model is scored on, read once: ``{"lines": {length:
    cases}}`` (asked line beyond K), ``"gate"`` (B's gate length, asked line anywhere) and, unless
    ``with_needle`` is false (an accuracy curve needs only the lines), ``"needle"``."""
    from . import needle

    cases = {
        "lines": {n: read_cases(run, f"lines-{n}.jsonl") for n in config.evaluation.lines_lengths},
        "gate": read_cases(run, f"gate-{config.base.gate.length}.jsonl"),
    }
    if with_needle:
        cases["needle"] = needle.read_needle_cases(run.path("data", "cases", "needle.jsonl"))
        if config.evaluation.two_hop_length:
            cases["two_hop"] = read_cases(run, "two_hop.jsonl")
    return cases


def benchmark_results(model, tokenizer, cases: dict, config: Population) -> dict:
    """A model's benchmarks on ``cases`` (:func:`read_benchmark_cases`), each keeping its outputs:
    ``"lines"`` per length, ``"acc512"`` (the gate's cases), ``"needle"``, and ``"log_likelihood"``
    of the answer digits per lines length (one value per case)."""
    from . import lines, needle

    batch_size = config.evaluation.batch_size
    found = {
        "lines": {str(n): lines_result(model, tokenizer, group, config) for n, group in cases["lines"].items()},
        "acc512": lines_result(model, tokenizer, cases["gate"], config),
        "needle": lines_result(model, tokenizer, cases["needle"], config, needle.needle_accuracy),
        "log_likelihood": {
            str(n): lines.answer_log_likelihood(model, tokenizer, group, batch_size=batch_size)
            for n, group in cases["lines"].items()
        },
    }
    if "two_hop" in cases:  # scored like lines: the last number of the output is the named line's
        found["two_hop"] = lines_result(model, tokenizer, cases["two_hop"], config)
    return found


def check_gate(config: Population, run: RunFolder, spec: Pretrained) -> dict:
    """Lines accuracy of ``spec`` at its gate's length; raises (after recording it) when below the gate."""
    path = ("eval", "gates", f"{spec.name}.json")
    if not run.has(*path):
        model, tokenizer = load_member(model_folder(run, spec.name), device_of(config))
        found = lines_result(model, tokenizer, read_cases(run, f"gate-{spec.gate.length}.jsonl"), config)
        found.update(model=spec.name, gate=dataclasses.asdict(spec.gate))
        found["passed"] = found["accuracy"] >= spec.gate.min_accuracy
        run.write_json(found, *path)
    record = run.read_json(*path)
    run.log(f"{spec.name}: gate lines accuracy {record['accuracy']:.3f} at {spec.gate.length} tokens")
    if not record["passed"]:
        raise ValueError(
            f"{spec.name} fails its gate: lines accuracy {record['accuracy']:.3f} at {spec.gate.length} tokens is below "
            f"{spec.gate.min_accuracy} (recorded in {run.path(*path)}); the population cannot be measured with it, so "
            "the run stops here: train it longer or change the plan."
        )
    return record


def stage_base(config: Population, run: RunFolder, members=None) -> None:
    pretrain(config, run, config.base)


def selected_evaluators(config: Population, names=None) -> list[Pretrained]:
    """The enabled evaluators, or those of them named in ``names`` (``--evaluators``)."""
    enabled = [spec for spec in config.evaluators if spec.enabled]
    unknown = [n for n in names or [] if n not in [spec.name for spec in enabled]]
    if unknown:
        raise ValueError(
            f"--evaluators names {unknown}, which are not enabled evaluators of the config: {[s.name for s in enabled]}."
        )
    return [spec for spec in enabled if not names or spec.name in names]


def stage_evaluators(config: Population, run: RunFolder, members=None, evaluators=None) -> None:
    for spec in selected_evaluators(config, evaluators):
        pretrain(config, run, spec)


def extended_config(config: Population, base_folder: str, extension):
    """B's config extended by ``extension`` to ``data.length`` positions, and the attention to load it with."""
    from transformers import AutoConfig

    from longce.context_extension import apply_context_extension

    model_config = AutoConfig.from_pretrained(base_folder)
    if extension.method == "ntk":  # NTK-aware scaling is an ABF with a base set by the factor
        theta = extension.ntk_theta(config.base.shape.rope_theta, config.base.shape.head_dim)
        attention = apply_context_extension(model_config, "abf", rope_theta=theta)
    else:
        attention = apply_context_extension(
            model_config,
            extension.method,
            factor=extension.factor,
            rope_theta=extension.rope_theta,
            eabf_base_length=extension.eabf_base_length or 4096,
        )
    # ABF changes only the base: the positions the model may read become L.
    model_config.max_position_embeddings = max(model_config.max_position_embeddings, config.data.length)
    return model_config, attention or "sdpa"


def parse_shard(value: str) -> tuple[int, int]:
    """``"i/n"`` (``0 <= i < n``) as ``(i, n)``: the i-th of n interleaved slices of the members."""
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{value!r} is not a shard; give i/n with 0 <= i < n, e.g. 0/4")
    return index, count


def selected_members(config: Population, names, shard: tuple[int, int] | None = None):
    """The members named in ``names`` (all when empty), in the config's order; with ``shard``
    ``(i, n)`` only every n-th of them from the i-th (interleaved, so that each slice holds every
    step count: one process per GPU gets about equal work)."""
    members = config.members()
    known = [m.name for m in members]
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"--members names {unknown}, which are not members of the config's population: {known}.")
    chosen = [m for m in members if names is None or m.name in names]
    return chosen[shard[0] :: shard[1]] if shard else chosen


def claim_order(members: list) -> list:
    """The order processes sharing a call (``--claim``) take members in: every first seed before any
    second one (config order within), so that a call cut short leaves whole replicates undone
    rather than whole configurations."""
    return sorted(members, key=lambda m: m.replicate)


def claimed(run: RunFolder, claim: str | None, stage: str, member: str) -> bool:
    """With ``claim`` (``--claim``, one id per call shared by the processes working side by side):
    whether ANOTHER process of this call has taken ``member`` for ``stage``; else this process takes
    it now (the file ``claims/<claim>/<stage>/<member>`` is created exclusively, so exactly one
    process gets each member). Without ``claim``: ``False``. Claims of an earlier call (another id)
    are ignored, so a member a cut-off call left half done is taken up again."""
    if not claim:
        return False
    path = run.path("claims", claim, stage, member)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return True
    return False


def stage_members(config: Population, run: RunFolder, members=None, claim: str | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from .family import Variant, is_trained, train_variant

    base = model_folder(run, config.base.name)
    if not is_trained(base):
        raise ValueError(f"The base {config.base.name} is not trained ({base}): run the 'base' stage first.")
    check_gate(config, run, config.base)
    tokenizer = load_tokenizer(run)
    chosen = selected_members(config, members)
    for member in claim_order(chosen) if claim else chosen:
        folder = member_folder(run, member.name)
        if is_trained(folder):
            run.log(f"members: {member.name} trained, kept")
            continue
        if claimed(run, claim, "members", member.name):
            continue
        model_config, attention = extended_config(config, base, member.extension)
        training = dataclasses.replace(config.finetune.training, steps=member.steps)
        variant = Variant(
            member.name,
            {"base": config.base.name, "extension": dataclasses.asdict(member.extension)},
            training.settings(member.seed),
        )

        def start(model_config=model_config, attention=attention):
            return AutoModelForCausalLM.from_pretrained(base, config=model_config, attn_implementation=attention)

        run.log(f"members: {member.name} ({member.extension.method}, {member.steps} steps, seed {member.seed})")
        mix = config.finetune.mix
        with run.timed("train", member.name):
            train_variant(
                variant,
                tokenizer,
                batches(run, training.seq_len, mix, member.seed),
                folder,
                device_of(config),
                run.log,
                start_from=start,
            )


# ------------------------------------------------------------------ key-token caches and calibration


def evaluator_cache(config: Population, run: RunFolder, evaluator: str, window: Window, documents: str) -> str:
    """The key-token cache of ``data/<documents>.jsonl`` by ``evaluator`` with ``window`` (built once)."""
    name = f"{evaluator}-K{window.trunc_len}-d{window.sliding_window}-{documents}"
    folder = os.path.dirname(run.path("caches", name, "x"))
    if not os.path.isfile(os.path.join(folder, "dataset_info.json")):
        source = run.path("data", f"{documents}.jsonl")
        if not os.path.isfile(source):
            raise ValueError(f"No documents at {source}: run the 'data' stage first.")
        # longppl-score's own main (what the command runs), in this process: no second start-up
        from longppl.cache.key_token_cache import compact_cache
        from longppl.tools import compute_key_tokens

        arguments = ["--corpus", source, "--evaluator", model_folder(run, evaluator), "--output", folder]
        arguments += ["--device", device_of(config), "--trunc-len", str(window.trunc_len)]
        arguments += ["--sliding-window", str(window.sliding_window), "--max-length", str(config.data.length)]
        run.log("$ longppl-score " + " ".join(arguments))
        with run.timed("cache", name):
            compute_key_tokens.main(arguments, prog="longppl-score")
            # one folder (dataset_info.json): the mark of a finished cache; a killed run resumes from its shards
            compact_cache(folder)
    return folder


def cache_scores(folder: str) -> tuple[list[str], list]:
    """``(texts, EvaluatorScores per text)`` of a one-configuration cache."""
    from longppl.cache.key_token_cache import KeyTokenCache

    cache = KeyTokenCache.load(folder)
    _, _, rows = cache.select()
    return cache.texts(rows), [cache.scores(row) for row in rows]


def tail_lsd_lcl(scores: list, start: int):
    """LSD and LCL of every token at index ``>= start`` of every document, concatenated."""
    import numpy as np

    lsd = np.concatenate([(s.lp_long - s.lp_short)[start:] for s in scores])
    lcl = np.concatenate([s.lp_long[start:] for s in scores])
    return lsd, lcl


def calibration_parts(config: Population, evaluator: str) -> tuple[str, ...]:
    """Where ``evaluator``'s calibration is written: ``eval/calibration.json`` for the first
    evaluator (the second attempt's file), ``eval/calibration-<name>.json`` for the others."""
    if evaluator == config.evaluators[0].name:
        return ("eval", "calibration.json")
    return ("eval", f"calibration-{evaluator}.json")


def stage_calibrate(config: Population, run: RunFolder, members=None, evaluators=None) -> None:
    """Each (selected) enabled evaluator calibrates its own alpha, before any member is scored; the
    key-token caches that the ``evaluate`` stage reads are built here, so that processes evaluating
    members side by side only read them."""
    for spec in selected_evaluators(config, evaluators):
        calibrate_one(config, run, spec)
        if spec.name == config.evaluators[0].name:
            evaluator_cache(config, run, spec.name, config.scoring.primary, "validation")
            evaluator_cache(config, run, spec.name, config.scoring.secondary, "validation")


def calibrate_one(config: Population, run: RunFolder, evaluator_spec: Pretrained) -> None:
    parts = calibration_parts(config, evaluator_spec.name)
    if run.has(*parts):
        run.log(f"calibrate: {evaluator_spec.name} alpha {run.read_json(*parts)['alpha']} (kept)")
        return
    from .calibration import calibrate_alpha

    spec, evaluator = config.calibration, evaluator_spec.name
    check_gate(config, run, evaluator_spec)
    _, real = cache_scores(evaluator_cache(config, run, evaluator, spec.window, "validation"))
    _, null = cache_scores(evaluator_cache(config, run, evaluator, spec.window, "null"))
    start = config.data.length - spec.window.trunc_len  # the tokens whose short context is the kept tail
    real_lsd, real_lcl = tail_lsd_lcl(real, start)
    null_lsd, null_lcl = tail_lsd_lcl(null, start)
    found = calibrate_alpha(
        real_lsd, real_lcl, null_lsd, null_lcl, grid=spec.grid, beta=spec.beta, max_null_ratio=spec.max_null_ratio
    )
    record = {**found, "evaluator": evaluator, "window": dataclasses.asdict(spec.window), "from_token": start}
    run.write_json(record, *parts)
    run.log(
        f"calibrate: {evaluator} alpha {found['alpha']} (null key tokens <= {spec.max_null_ratio:.0%} of the real ones)"
    )


# ------------------------------------------------------------------ evaluation


def calibrated_alpha(run: RunFolder, parts: tuple[str, ...] = ("eval", "calibration.json")) -> float:
    """The alpha of the calibration at ``parts`` (default: the first evaluator's)."""
    if not run.has(*parts):
        raise ValueError(f"No {parts[-1]} in {run.path('eval')}: run the 'calibrate' stage first.")
    return float(run.read_json(*parts)["alpha"])


def longppl_columns(config: Population, run: RunFolder, alpha: float) -> dict[str, dict]:
    """``{column: {cache, alpha, beta, soft}}``: what LongPPL of every member is computed with."""
    scoring, first = config.scoring, config.evaluators[0].name
    primary = evaluator_cache(config, run, first, scoring.primary, "validation")
    columns = {
        "primary": {"cache": primary, "alpha": alpha, "beta": scoring.beta, "soft": False},
        "secondary": {
            "cache": evaluator_cache(config, run, first, scoring.secondary, "validation"),
            "alpha": alpha,
            "beta": scoring.beta,
            "soft": False,
        },
        "soft": {"cache": primary, "alpha": alpha, "beta": scoring.beta, "soft": True},
    }
    for a in (alpha, *scoring.sensitivity_alphas):
        for b in scoring.sensitivity_betas:
            columns[f"alpha={a:g},beta={b:g}"] = {"cache": primary, "alpha": a, "beta": b, "soft": False}
    for spec in config.evaluators[1:]:
        if spec.enabled:  # each evaluator with the alpha it calibrated itself
            own = calibrated_alpha(run, calibration_parts(config, spec.name))
            cache = evaluator_cache(config, run, spec.name, scoring.primary, "validation")
            columns[f"primary:{spec.name}"] = {"cache": cache, "alpha": own, "beta": scoring.beta, "soft": False}
    return columns


def longppl_of(model, tokenizer, columns: dict, caches: dict, gamma: float, budget: int) -> dict:
    """PPL and LongPPL (pooled over documents) of ``model`` for every column, with per-document
    sums (for bootstraps)."""
    from longppl.core.scoring import document_results, score_with_model, summarize_results, text_key_weights

    by_texts: dict[tuple, list] = {}
    found = {}
    for name, column in columns.items():
        texts, scores = caches[column["cache"]]
        key = tuple(texts)
        if key not in by_texts:  # one pass of the model per distinct corpus
            by_texts[key] = score_with_model(model, tokenizer, texts, budget, progress=False)
        model_scores = by_texts[key]
        weights = text_key_weights(
            texts, scores, model_scores, column["alpha"], column["beta"], soft=column["soft"], gamma=gamma
        )
        per_document = document_results(model_scores, weights)
        # pooled: exp(total NLL / total tokens), the design's corpus value, which the document bootstrap resamples
        summary = summarize_results(per_document, "pooled", soft=column["soft"])
        found[name] = {
            "longppl": summary["longppl"],
            "ppl": summary["ppl"],
            "key_tokens": sum(r.n_key_tokens for r in per_document),
            "tokens": sum(r.n_predicted for r in per_document),
            "documents": {
                "key_nll": [r.key_nll for r in per_document],
                "key_tokens": [r.n_key_tokens for r in per_document],
                "nll": [r.nll for r in per_document],
                "tokens": [r.n_predicted for r in per_document],
            },
            **{k: column[k] for k in ("alpha", "beta", "soft")},
            "cache": os.path.basename(column["cache"]),
        }
    return found


def stage_evaluate(config: Population, run: RunFolder, members=None, claim: str | None = None) -> None:
    from .family import is_trained

    chosen = selected_members(config, members)
    pending = [
        m for m in (claim_order(chosen) if claim else chosen) if not run.has("eval", "members", f"{m.name}.json")
    ]
    if not pending:
        return
    alpha = calibrated_alpha(run)
    columns = longppl_columns(config, run, alpha)
    caches = {column["cache"]: cache_scores(column["cache"]) for column in columns.values()}
    cases = read_benchmark_cases(config, run)
    for member in pending:
        path = ("eval", "members", f"{member.name}.json")
        folder = member_folder(run, member.name)
        if not is_trained(folder):
            if claim:  # another process of this call may still be training it: left for a later pass
                run.log(f"evaluate: {member.name} is not trained yet, left for a later pass")
                continue
            raise ValueError(f"Member {member.name} is not trained ({folder}): run the 'members' stage first.")
        if claimed(run, claim, "evaluate", member.name):
            continue
        start = time.perf_counter()
        model, tokenizer = load_member(folder, device_of(config))
        evaluation = config.evaluation
        record = {"member": member.name, "seed": member.seed, "steps": member.steps}
        record["extension"] = dataclasses.asdict(member.extension)
        record.update(benchmark_results(model, tokenizer, cases, config))
        record["longppl"] = longppl_of(
            model, tokenizer, columns, caches, config.scoring.gamma, evaluation.max_tokens_per_batch
        )
        seconds = time.perf_counter() - start
        record["seconds"] = seconds
        run.write_json(record, *path)
        run.add_seconds("evaluate", member.name, seconds)
        mean = sum(v["accuracy"] for v in record["lines"].values()) / len(record["lines"])
        run.log(
            f"evaluate: {member.name} primary accuracy {mean:.3f}, LongPPL {record['longppl']['primary']['longppl']:.3f}, "
            f"PPL {record['longppl']['primary']['ppl']:.3f} ({seconds:.1f}s)"
        )


def stage_answer_tokens(config: Population, run: RunFolder, members=None) -> None:
    """Figure 5(b) on E1: answer tokens vs the other answer-side tokens, by LSD alone and LSD + LCL,
    at the configured alphas and the calibrated one (counts, for Wilson intervals)."""
    if run.has("eval", "answer_tokens.json"):
        return
    import numpy as np

    from longppl.settings import WindowSettings

    from . import answer_tokens

    alpha = calibrated_alpha(run)
    evaluator = config.evaluators[0].name
    model, tokenizer = load_member(model_folder(run, evaluator), device_of(config))
    window = WindowSettings(config.scoring.primary.trunc_len, config.scoring.primary.sliding_window)
    scored = answer_tokens.answer_token_scores(model, tokenizer, read_cases(run, "answer_tokens.jsonl"), window=window)
    lsd, lcl, is_answer = (np.asarray(scored[k]) for k in ("lsd", "lcl", "is_answer"))
    by_alpha = {
        f"{a:g}": answer_tokens.classify_answer_tokens(lsd, lcl, is_answer, alpha=a, beta=config.scoring.beta)
        for a in dict.fromkeys((*config.answer_tokens.alphas, alpha))
    }
    record = {"evaluator": evaluator, "calibrated_alpha": alpha, "tokens": int(lsd.size)}
    record.update(answer_tokens=int(is_answer.sum()), by_alpha=by_alpha)
    run.write_json(record, "eval", "answer_tokens.json")
    run.log(f"answer_tokens: {record['answer_tokens']} answer tokens of {record['tokens']}")


# ------------------------------------------------------------------ report


def member_row(member, record: dict, analysis) -> dict:
    """A member's row of the results table."""
    primary = record["longppl"]["primary"]
    per_length = {n: v["accuracy"] for n, v in record["lines"].items()}
    outputs = sum(v["total"] for v in record["lines"].values())
    from .third_attempt import no_answer_shape_share

    row = {
        "member": member.name,
        "method": member.extension.method,
        "extension": member.extension.name,
        "configuration": member.configuration,
        "control": member.extension.control,
        "factor": member.extension.factor,
        "rope_theta": member.extension.rope_theta,
        "steps": member.steps,
        "seed": member.seed,
        "acc512": record["acc512"]["accuracy"],
        "accuracy": per_length,
        # exact fractions, rounded once: members with equal counts tie exactly (a float sum's last bit
        # depends on the order of the lengths, and Spearman's average ranks see the difference)
        "primary_accuracy": float(
            sum(Fraction(v["correct"], v["total"]) for v in record["lines"].values()) / len(record["lines"])
        ),
        "no_number_share": sum(v["no_number"] for v in record["lines"].values()) / outputs,
        "no_answer_shape_share": no_answer_shape_share(record),
        "needle": record["needle"]["accuracy"],
        "two_hop": record["two_hop"]["accuracy"] if "two_hop" in record else None,
        "log_likelihood": {n: float(sum(v) / len(v)) for n, v in record["log_likelihood"].items()},
        "mean_log_likelihood": float(
            sum(sum(v) for v in record["log_likelihood"].values())
            / sum(len(v) for v in record["log_likelihood"].values())
        ),
        "ppl": primary["ppl"],
        "longppl": primary["longppl"],
        "longppl_secondary": record["longppl"]["secondary"]["longppl"],
        "soft_longppl": record["longppl"]["soft"]["longppl"],
        "key_tokens": primary["key_tokens"],
        "sensitivity": {k: v["longppl"] for k, v in record["longppl"].items() if k.startswith("alpha=")},
        **{
            f"longppl:{k[len('primary:') :]}": v["longppl"]
            for k, v in record["longppl"].items()
            if k.startswith("primary:")
        },
        "intervals": {
            "ppl": document_interval(primary["documents"]["nll"], primary["documents"]["tokens"], analysis),
            "longppl": document_interval(primary["documents"]["key_nll"], primary["documents"]["key_tokens"], analysis),
        },
        "seconds": record["seconds"],
    }
    return row


def document_interval(nll, counts, analysis) -> dict:
    """A percentile bootstrap interval over documents of the corpus perplexity
    ``exp(sum nll / sum counts)`` (documents resampled with replacement; ``nll[i]`` and ``counts[i]``
    are document ``i``'s summed negative log-likelihood and token count, or key-token weight)."""
    import numpy as np

    nll, counts = np.asarray(nll, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    rng = np.random.default_rng(analysis.seed)
    picks = rng.integers(0, nll.shape[0], size=(analysis.resamples, nll.shape[0]))
    totals = counts[picks].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = np.exp(nll[picks].sum(axis=1) / totals)[totals > 0]
    value = math.exp(nll.sum() / counts.sum()) if counts.sum() > 0 else float("nan")
    tail = (1 - analysis.level) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail]) if samples.size else (float("nan"), float("nan"))
    return {"value": value, "low": float(low), "high": float(high), "level": analysis.level}


def exclusion(row: dict, base_acc512: float, analysis) -> str | None:
    """Why ``row`` is left out of the analysis (the plan's rules), or ``None``."""
    if row["acc512"] < analysis.min_acc512_ratio * base_acc512:
        return (
            f"accuracy at 512 tokens {row['acc512']:.3f} is below {analysis.min_acc512_ratio:g} of the base's "
            f"{base_acc512:.3f}"
        )
    if row["no_number_share"] > analysis.max_no_number_share:
        return f"{row['no_number_share']:.0%} of its lines outputs hold no number"
    return None


def statistics_of(
    rows: list[dict], analysis, measure: str = "longppl", benchmark: str = "primary_accuracy", share: bool = True
) -> dict:
    """The plan's statistics over ``rows``: correlations of ``measure`` (LongPPL) and PPL with
    ``benchmark`` (bootstrap intervals, over members and clustered by extension method), their
    paired difference, Williams' t, the partial correlation given acc512, and the inconclusive flag
    with its reasons: fewer than ``analysis.min_members`` members, or (for a benchmark that is a
    ``share`` in [0, 1], i.e. an accuracy) more than ``analysis.inconclusive_share`` of them at its
    floor or ceiling. A log-likelihood has neither, so ``share=False`` leaves that count out
    (``at_floor_or_ceiling`` is ``None``)."""
    from . import statistics

    usable = [r for r in rows if finite(r[measure]) and finite(r["ppl"]) and finite(r[benchmark])]
    if len(usable) < 3:
        return {
            "members": [r["member"] for r in usable],
            "skipped": f"{len(usable)} members with a finite {measure}, PPL and {benchmark}; 3 are needed",
            "inconclusive": True,
        }
    longppl = [r[measure] for r in usable]
    ppl = [r["ppl"] for r in usable]
    accuracy = [r[benchmark] for r in usable]
    clusters = [r["method"] for r in usable]
    common = analysis.bootstrap
    found = {"members": [r["member"] for r in usable], "n": len(usable)}
    for method in ("pearson", "spearman"):
        found[method] = {
            "longppl": statistics.bootstrap_correlation(longppl, accuracy, method, **common),
            "ppl": statistics.bootstrap_correlation(ppl, accuracy, method, **common),
            "difference": statistics.paired_bootstrap_difference(longppl, ppl, accuracy, method, **common),
            "longppl_by_method": statistics.bootstrap_correlation(
                longppl, accuracy, method, clusters=clusters, **common
            ),
            "ppl_by_method": statistics.bootstrap_correlation(ppl, accuracy, method, clusters=clusters, **common),
            "difference_by_method": statistics.paired_bootstrap_difference(
                longppl, ppl, accuracy, method, clusters=clusters, **common
            ),
        }
    r_ay, r_by = found["pearson"]["longppl"]["value"], found["pearson"]["ppl"]["value"]
    r_ab = statistics.correlation(longppl, ppl)
    if not all(finite(r) for r in (r_ay, r_by, r_ab)):  # a side without variance (e.g. every accuracy 0)
        found["williams_t"] = {"t": None, "df": None, "p_two_sided": None, "skipped": "a correlation is undefined"}
    elif abs(r_ab) >= 1 - 1e-12:  # the two measures rank alike: nothing to compare (the test divides by 0)
        found["williams_t"] = {"t": None, "df": None, "p_two_sided": None, "skipped": "|r(LongPPL, PPL)| = 1"}
    else:
        found["williams_t"] = statistics.williams_t(r_ay, r_by, r_ab, len(usable))
    found["partial_given_acc512"] = statistics.bootstrap_partial_correlation(
        longppl, accuracy, [r["acc512"] for r in usable], **common
    )
    reasons = []
    if len(usable) < analysis.min_members:
        reasons.append(f"{len(usable)} members analysed, fewer than the {analysis.min_members} the plan needs")
    extreme = int(sum(a <= analysis.floor or a >= analysis.ceiling for a in accuracy)) if share else None
    if share and extreme > analysis.inconclusive_share * len(usable):
        reasons.append(
            f"{extreme} of {len(usable)} members at <= {analysis.floor} or >= {analysis.ceiling}, "
            f"more than {analysis.inconclusive_share:.0%}"
        )
    found.update(inconclusive=bool(reasons), inconclusive_reasons=reasons, at_floor_or_ceiling=extreme)
    return found


def sensitivity_statistics(rows: list[dict], analysis, benchmark: str = "primary_accuracy") -> dict:
    """Pearson and Spearman correlations (bootstrap intervals over members) of every other
    measure in the rows with ``benchmark``: LongPPL at each (alpha, beta) of the sensitivity grid,
    with the secondary window, the soft (LongCE-weighted) LongPPL, and PPL for reference.

    Returns ``{measure: {"pearson": ..., "spearman": ...}}`` (``statistics.bootstrap_correlation``
    records); a measure some row lacks or holds as non-finite is left out."""
    from . import statistics

    measures = {
        f"LongPPL {k}": [r["sensitivity"].get(k) for r in rows] for k in (rows[0]["sensitivity"] if rows else ())
    }
    measures.update(
        {
            "LongPPL, secondary window": [r["longppl_secondary"] for r in rows],
            "soft LongPPL": [r["soft_longppl"] for r in rows],
            "PPL": [r["ppl"] for r in rows],
        }
    )
    accuracy = [r[benchmark] for r in rows]
    common = analysis.bootstrap
    return {
        name: {
            method: statistics.bootstrap_correlation(values, accuracy, method, **common)
            for method in ("pearson", "spearman")
        }
        for name, values in measures.items()
        if len(rows) >= 3 and all(finite(v) for v in values)
    }


def verdict(found: dict, analysis) -> dict:
    """The plan's outcome for the primary statistics ``found`` (:func:`statistics_of`):
    ``"inconclusive"`` by its rules; ``"reproduced"`` when LongPPL's Pearson r with the accuracy is at
    most ``analysis.success_max_r``, the upper end of its interval below ``analysis.success_max_high``
    and the whole interval of r(LongPPL) - r(PPL) below 0; else ``"not reproduced"``. Each condition
    is returned with whether it holds, so the report shows why."""
    if "skipped" in found:
        return {"outcome": "inconclusive", "conditions": [], "reasons": [found["skipped"]]}
    r, difference = found["pearson"]["longppl"], found["pearson"]["difference"]
    conditions = [
        (
            f"Pearson r(LongPPL, accuracy) {r['value']:.3f} <= {analysis.success_max_r}",
            r["value"] <= analysis.success_max_r,
        ),
        (
            f"its {analysis.level:.0%} upper bound {r['high']:.3f} < {analysis.success_max_high}",
            r["high"] < analysis.success_max_high,
        ),
        (f"r(LongPPL) - r(PPL): interval's upper bound {difference['high']:.3f} < 0", difference["high"] < 0),
    ]
    if found["inconclusive"]:
        outcome = "inconclusive"
    else:
        outcome = "reproduced" if all(held for _, held in conditions) else "not reproduced"
    return {
        "outcome": outcome,
        "conditions": [{"condition": text, "holds": bool(held)} for text, held in conditions],
        "reasons": found["inconclusive_reasons"],
    }


def results_header(config: Population) -> dict:
    """What every ``results.json`` starts with: the command line, the config and every seed."""
    return {
        "command": command_line("longppl-reproduce"),
        "config": dataclasses.asdict(config),
        "seeds": {
            "run": config.seed,
            config.base.name: config.base.seed,
            **{e.name: e.seed for e in config.evaluators if e.enabled},
            **{m.name: m.seed for m in config.members()},
        },
    }


def stage_report(config: Population, run: RunFolder, members=None) -> dict:
    if config.analysis.plan == "third":
        from . import third_attempt

        return third_attempt.report(config, run)
    rows = []
    base_gate = run.read_json("eval", "gates", f"{config.base.name}.json")
    for member in config.members():
        row = member_row(member, run.read_json("eval", "members", f"{member.name}.json"), config.analysis)
        reason = exclusion(row, base_gate["accuracy"], config.analysis)
        row.update(excluded=reason is not None, exclusion_reason=reason)
        rows.append(row)
    analysed = [r for r in rows if not r["excluded"]]
    results = {
        **results_header(config),
        "gates": {
            spec.name: _without_outputs(run.read_json("eval", "gates", f"{spec.name}.json"))
            for spec in gate_specs(config)
        },
        "calibration": run.read_json("eval", "calibration.json"),
        "members": rows,
        "statistics": {
            "analysed": statistics_of(analysed, config.analysis),
            "all": statistics_of(rows, config.analysis),
        },
        # secondary: no success claim rests on these
        "secondary_statistics": {
            "needle": statistics_of(analysed, config.analysis, benchmark="needle"),
            "log_likelihood": statistics_of(analysed, config.analysis, benchmark="mean_log_likelihood", share=False),
            **{
                f"longppl:{e.name}": statistics_of(analysed, config.analysis, measure=f"longppl:{e.name}")
                for e in config.evaluators[1:]
                if e.enabled
            },
        },
        "answer_tokens": with_wilson_intervals(run.read_json("eval", "answer_tokens.json"), config.analysis.level),
        "timings": run.timings(),
    }
    results["sensitivity"] = sensitivity_statistics(analysed, config.analysis)
    results["verdict"] = verdict(results["statistics"]["analysed"], config.analysis)
    results["figures"] = draw_figure(run, analysed)
    return run.write_report(results, format_report(results))


def with_wilson_intervals(record: dict, level: float) -> dict:
    """The answer-token record with Wilson intervals of each rule's recall (over the answer tokens)
    and specificity (over the others), from the counts behind them."""
    from .statistics import wilson_interval

    for found in record["by_alpha"].values():
        for rule in ("lsd", "lsd+lcl"):
            for rate, total in (("recall", found["n_answer"]), ("specificity", found["n_other"])):
                value = found[rule][rate]
                if total and finite(value):
                    found[rule][f"{rate}_interval"] = wilson_interval(round(value * total), total, level)
    return record


def _without_outputs(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "outputs"}


def draw_figure(run: RunFolder, rows: list[dict]) -> list[str]:
    """The Figure 1(b) scatter of the analysed members (none without matplotlib or with < 2 members)."""
    rows = [r for r in rows if finite(r["longppl"]) and finite(r["ppl"])]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        run.log("report: matplotlib is not installed, so no figure is drawn (pip install matplotlib)")
        return []
    if len(rows) < 2:
        return []
    from longppl.tools.figures import correlation_scatter

    path = run.path("figures", "correlation.png")
    names = [r["member"] for r in rows]
    correlation_scatter(
        path,
        names,
        [r["longppl"] for r in rows],
        [r["ppl"] for r in rows],
        [r["primary_accuracy"] for r in rows],
        "primary lines accuracy",
    )
    return [os.path.relpath(path, run.root)]


def _pair(bounds) -> str:
    return f"[{fmt(bounds[0])}, {fmt(bounds[1])}]" if bounds else "[n/a]"


def _interval(found: dict) -> str:
    return f"{fmt(found['value'], 2)} [{fmt(found['low'], 2)}, {fmt(found['high'], 2)}]"


def format_report(results: dict) -> str:
    """``report.md``: the members' table, exclusions, the statistics, the answer tokens, wall times."""
    out = ["# LongPPL over a population of context extensions", "", "```", results["command"], "```", ""]
    out += [f"Calibrated alpha: **{results['calibration']['alpha']}**.", ""]
    out += ["PPL and LongPPL with their bootstrap intervals over documents; LongPPL (K2): the secondary window.", ""]
    out += [
        "| member | method | steps | seed | acc512 | primary acc | needle | PPL | LongPPL | LongPPL (K2) | key tokens | excluded |"
    ]
    out += ["|---" * 12 + "|"]
    for r in results["members"]:
        out.append(
            f"| {r['member']} | {r['method']} | {r['steps']} | {r['seed']} | {fmt(r['acc512'])} | "
            f"{fmt(r['primary_accuracy'])} | {fmt(r['needle'])} | {_interval(r['intervals']['ppl'])} | "
            f"{_interval(r['intervals']['longppl'])} | "
            f"{fmt(r['longppl_secondary'], 2)} | {r['key_tokens']:.0f} | {r['exclusion_reason'] or ''} |"
        )
    sections = [(f"{label} members, primary accuracy", found) for label, found in results["statistics"].items()]
    sections += [(f"secondary: {label}", found) for label, found in results["secondary_statistics"].items()]
    for label, found in sections:
        out += ["", f"## Statistics ({label})", ""]
        if "skipped" in found:
            out.append(f"Skipped: {found['skipped']}.")
            continue
        out += ["| correlation | LongPPL | PPL | LongPPL - PPL (p) |", "|---|---|---|---|"]
        for method in ("pearson", "spearman"):
            for suffix, label_ in (("", "members"), ("_by_method", "clusters: methods")):
                lp, p, d = (found[method][k + suffix] for k in ("longppl", "ppl", "difference"))
                out.append(
                    f"| {method} ({label_}) | {fmt(lp['value'])} [{fmt(lp['low'])}, {fmt(lp['high'])}] | "
                    f"{fmt(p['value'])} [{fmt(p['low'])}, {fmt(p['high'])}] | {fmt(d['value'])} ({fmt(d['p_two_sided'])}) |"
                )
        w, partial = found["williams_t"], found["partial_given_acc512"]
        out += [
            "",
            f"Williams' t {fmt(w['t'])} (p {fmt(w['p_two_sided'])}); partial r given acc512 "
            f"{fmt(partial['value'])} [{fmt(partial['low'])}, {fmt(partial['high'])}].",
        ]
        reasons = "; ".join(found["inconclusive_reasons"]) or "no rule applies"
        out.append(f"Inconclusive: {found['inconclusive']} ({reasons}).")
    out += ["", "## Sensitivity (analysed members, primary accuracy)", ""]
    out += ["| measure | Pearson | Spearman |", "|---|---|---|"]
    for name, found in results["sensitivity"].items():
        out.append(f"| {name} | {_interval(found['pearson'])} | {_interval(found['spearman'])} |")
    decided = results["verdict"]
    out += ["", f"## Outcome by the analysis plan: **{decided['outcome']}**", ""]
    out += [f"- {c['condition']}: {'holds' if c['holds'] else 'does not hold'}" for c in decided["conditions"]]
    out += [f"- inconclusive: {reason}" for reason in decided["reasons"]]
    answer = results["answer_tokens"]
    out += [
        "",
        f"## Answer tokens (evaluator {answer['evaluator']}, {answer['answer_tokens']} of {answer['tokens']} tokens)",
        "",
    ]
    for alpha, found in answer["by_alpha"].items():
        for rule in ("lsd", "lsd+lcl"):
            got = found[rule]
            recall, specificity = got.get("recall_interval"), got.get("specificity_interval")
            out.append(
                f"- alpha {alpha}, {rule}: balanced accuracy {fmt(got['balanced_accuracy'])}; recall "
                f"{fmt(got['recall'])} {_pair(recall)}, specificity {fmt(got['specificity'])} {_pair(specificity)} "
                f"({found['n_answer']} answer, {found['n_other']} other tokens)"
            )
    return "\n".join(out + closing_sections(results)) + "\n"


# ------------------------------------------------------------------ export


def stage_export(config: Population, run: RunFolder, members=None, export_dir: str | None = None) -> None:
    """B and E1 in bf16 with shards of at most 15 MB (plus the tokenizer) into ``export_dir``."""
    if not export_dir:
        raise ValueError("The 'export' stage needs --export-dir (a folder for the exported models).")
    import torch

    from longppl.atomic_files import replace_directory_atomically

    for spec in (config.base, config.evaluators[0]):
        target = os.path.join(os.path.abspath(export_dir), spec.name)
        if os.path.exists(target):
            if os.path.isfile(os.path.join(target, "exported.json")):
                run.log(f"export: {target} exists, kept")
                continue
            raise ValueError(f"--export-dir: {target} exists and was not written by an export; give another folder.")
        model, tokenizer = load_member(model_folder(run, spec.name), "cpu")
        model = model.to(torch.bfloat16)

        def write(tmp: str, model=model, tokenizer=tokenizer, spec=spec) -> None:
            model.save_pretrained(tmp, max_shard_size="15MB")
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, "exported.json"), "w", encoding="utf-8") as handle:
                json.dump({"model": spec.name, "seed": spec.seed, "dtype": "bfloat16"}, handle)

        os.makedirs(os.path.dirname(target), exist_ok=True)
        replace_directory_atomically(target, write)
        run.log(f"export: {spec.name} -> {target}")


# ------------------------------------------------------------------ command line


def parse_stages(value: str, stages: tuple[str, ...] = STAGES) -> list[str]:
    """The stages named in ``value`` (comma separated; ``all``: every one but ``export``), in the
    order of ``stages`` (this pipeline's, or another's that shares the command line's form)."""
    names = [s.strip() for s in value.split(",") if s.strip()]
    if names == ["all"]:
        return [s for s in stages if s != "export"]
    unknown = [s for s in names if s not in stages]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown stages {unknown or value!r}; choose from {', '.join(stages)} or all")
    return [s for s in stages if s in names]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument("--config", required=True, help="the experiment's YAML config (required)")
    parser.add_argument("--output-dir", required=True, help="where every stage writes (kept between calls; required)")
    parser.add_argument(
        "--corpus", help="training books (.jsonl, .jsonl.gz, datasets dir or Hub id); overrides the config's"
    )
    parser.add_argument("--validation-corpus", help="validation books, same formats; overrides the config's")
    parser.add_argument(
        "--stages",
        type=parse_stages,
        default=[s for s in STAGES if s != "export"],
        help=f"comma-separated stages of {', '.join(STAGES)}, or all (every one but export; default: all)",
    )
    parser.add_argument("--members", help="comma-separated members to train / evaluate in this call (default: all)")
    parser.add_argument(
        "--shard",
        type=parse_shard,
        help="i/n: train / evaluate only every n-th of the (selected) members from the i-th, e.g. one process per GPU",
    )
    parser.add_argument(
        "--claim",
        help="an id shared by processes working side by side in one call (e.g. one per GPU): each member is "
        "trained / evaluated by the first process to claim it (claims/<id>/); use a new id for every call",
    )
    parser.add_argument(
        "--evaluators", help="comma-separated evaluators to train / calibrate in this call (default: every enabled one)"
    )
    parser.add_argument("--export-dir", help="where the export stage writes B and E1 (bf16, shards <= 15 MB)")
    return parser


def main(argv=None, prog: str | None = None) -> dict | None:
    """Run the stages; returns ``results.json``'s content when the report stage ran."""
    args = build_parser(prog).parse_args(argv)
    config = read_population(args.config, args.corpus, args.validation_corpus)
    members = [m.strip() for m in args.members.split(",") if m.strip()] if args.members else None
    chosen = selected_members(config, members, args.shard)  # an unknown name fails before any work
    if args.shard:
        members = [m.name for m in chosen]
    if args.claim and folder_name(args.claim):
        raise ValueError(f"--claim {args.claim!r}: {folder_name(args.claim)} (it names a folder under claims/).")
    evaluators = [e.strip() for e in args.evaluators.split(",") if e.strip()] if args.evaluators else None
    selected_evaluators(config, evaluators)
    run = RunFolder(args.output_dir)

    def run_stage(stage: str):
        extra = {"export_dir": args.export_dir} if stage == "export" else {}
        if stage in ("evaluators", "calibrate"):
            extra = {"evaluators": evaluators}
        if stage in ("members", "evaluate"):
            extra = {"claim": args.claim}
        return globals()[f"stage_{stage}"](config, run, members, **extra)

    return run.run_stages(args.stages, run_stage)


def cli(argv=None) -> int:
    """The ``longppl-reproduce`` command: :func:`main`, bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
