"""The reproduction's shared stages and helpers: the stages and helper functions that the LongPPL
population (``longppl_reproduce.population``) and the LongCE comparison
(``longppl_reproduce.longce_comparison``) both run on a run folder: tokenizer, data (documents, task
pools, benchmark cases), pretraining and gates, context extension, loading models, key-token caches
and alpha's calibration, benchmark and LongPPL scoring, and the ``--stages`` parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from .books import read_books
from .config import Population, Pretrained, Window
from .run_folder import RunFolder, read_record, write_jsonl

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
        if spec.gate.length not in lengths and not run.has("data", "cases", gate_cases_name(spec.gate.length)):
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


def run_data_jobs(config, run: RunFolder, jobs: list[tuple], worker=None) -> None:
    """Run ``jobs`` (:func:`data_jobs`) in worker processes, one per CPU core at most: generating
    cases and documents is tokenizer-bound Python, minutes for one process on the H200 config. The
    files do not depend on the order the jobs run in (each job seeds its own generator).
    ``worker(config, root, job) -> line to log`` runs one job (default :func:`run_data_job`; a
    pipeline with files of its own passes its own, and ``config`` is what that worker reads)."""
    import concurrent.futures
    import multiprocessing

    worker = worker or run_data_job

    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            run.log(worker(config, run.root, job))
        return
    # spawn, not fork: the parent holds a Rust tokenizer and may hold CUDA state
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for message in pool.map(worker, [config] * len(jobs), [run.root] * len(jobs), jobs):
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

    evaluation, seed, gate = config.evaluation, config.seed, spec.gate
    if gate.lines is None:
        # The greedy answer follows the prompt inside the model's positions.
        target = gate.length - evaluation.max_new_tokens
        num_lines = lines.lines_for_token_length(tokenizer, target, seed=seed)
    else:
        num_lines = gate.lines
    cases = lines.generate_lines_cases(num_lines, gate.cases, seed + gate.length)
    if gate.lines is not None:
        longest = max(len(tokenizer(case.prompt, add_special_tokens=True)["input_ids"]) for case in cases)
        if longest + evaluation.max_new_tokens > gate.length:
            raise ValueError(
                f"{spec.name}'s gate asks records of gate.lines = {gate.lines} lines: the longest prompt takes "
                f"{longest} tokens, and with the greedy answer's evaluation.max_new_tokens = "
                f"{evaluation.max_new_tokens} that is {longest + evaluation.max_new_tokens}, more than gate.length "
                f"= {gate.length}; ask fewer lines or a longer gate."
            )
    lines.write_lines_cases(run.path("data", "cases", gate_cases_name(spec.gate.length)), cases)
    return f"data: {len(cases)} gate cases of {num_lines} lines for {spec.name}"


def gate_cases_name(length: int) -> str:
    """The file of gate cases of ``length`` tokens (the asked line anywhere), one a length: every
    model gated at that length reads it."""
    return f"gate-{length}.jsonl"


def lines_cases_name(length: int, beyond: int | None = None) -> str:
    """The file of lines cases of ``length`` tokens asked beyond ``beyond`` (None: ``evaluation.beyond``)."""
    return f"lines-{length}.jsonl" if beyond is None else f"lines-{length}-beyond{beyond}.jsonl"


def write_lines_cases_beyond(config: Population, run: RunFolder, tokenizer, length: int, beyond=None) -> str:
    """Lines cases of ``length`` tokens whose asked line lies more than K tokens (``beyond`` when
    given) before the question."""
    from . import lines

    evaluation = config.evaluation
    far = evaluation.beyond if beyond is None else beyond
    seed = config.seed + length + (0 if beyond is None else 7919 * beyond)  # another draw per beyond
    cases = lines.lines_cases_beyond(tokenizer, length, evaluation.cases, far, seed)
    lines.write_lines_cases(run.path("data", "cases", lines_cases_name(length, beyond)), cases)
    return f"data: {len(cases)} lines cases of {length} tokens, asked beyond {far}"


def write_needle_cases(config: Population, run: RunFolder, tokenizer, length: int | None = None) -> str:
    """Needle cases in the validation books, the asked needle more than K tokens before the question:
    ``needle.jsonl`` at ``evaluation.needle_length``, or ``needle-<length>.jsonl`` at ``length``."""
    import numpy as np

    from . import needle

    evaluation = config.evaluation
    validation = validation_books(config)
    cases = needle.make_needle_cases(
        tokenizer,
        np.concatenate(book_ids(tokenizer, validation)),
        length or evaluation.needle_length,
        evaluation.cases,
        needles=config.data.needles,
        beyond=evaluation.beyond,
        seed=config.seed,
    )
    needle.write_needle_cases(run.path("data", "cases", f"needle-{length}.jsonl" if length else "needle.jsonl"), cases)
    return f"data: {len(cases)} needle cases of {length or evaluation.needle_length} tokens"


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


def write_passage_recall_cases(
    config: Population, run: RunFolder, tokenizer, length: int, beyond: int | None = None
) -> str:
    """Passage-recall cases (``passage_recall``) in the validation books, their context ``length``
    tokens (the cue included; the scored tokens follow), the span more than ``beyond`` tokens
    (default ``evaluation.beyond``) before the cue -> ``data/cases/passage_recall.jsonl``, which
    :func:`read_benchmark_cases` then reads. No stage writes it: a pipeline that measures the task
    calls this."""
    from . import passage_recall

    evaluation = config.evaluation
    beyond = evaluation.beyond if beyond is None else beyond
    cases = passage_recall.passage_recall_cases(
        book_ids(tokenizer, validation_books(config)), length, beyond, evaluation.cases, config.seed + 3
    )
    passage_recall.write_passage_recall_cases(run.path("data", "cases", "passage_recall.jsonl"), cases)
    return f"data: {len(cases)} passage-recall cases of {length} tokens, the span beyond {beyond}"


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
    ``with_needle`` is false (an accuracy curve needs only the lines), ``"needle"``, ``"two_hop"``
    when configured and ``"passage_recall"`` when its file was written
    (:func:`write_passage_recall_cases`)."""
    from . import needle, passage_recall

    cases = {
        "lines": {n: read_cases(run, f"lines-{n}.jsonl") for n in config.evaluation.lines_lengths},
        "gate": read_cases(run, gate_cases_name(config.base.gate.length)),
    }
    if with_needle:
        cases["needle"] = needle.read_needle_cases(run.path("data", "cases", "needle.jsonl"))
        if config.evaluation.two_hop_length:
            cases["two_hop"] = read_cases(run, "two_hop.jsonl")
        if run.has("data", "cases", "passage_recall.jsonl"):
            path = run.path("data", "cases", "passage_recall.jsonl")
            cases["passage_recall"] = passage_recall.read_passage_recall_cases(path)
    return cases


def benchmark_results(model, tokenizer, cases: dict, config: Population) -> dict:
    """A model's benchmarks on ``cases`` (:func:`read_benchmark_cases`), each keeping its outputs:
    ``"lines"`` per length, ``"acc512"`` (the gate's cases), ``"needle"``, and ``"log_likelihood"``
    of the answer digits per lines length (one value per case); ``"two_hop"`` and
    ``"passage_recall"`` (:func:`passage_recall.passage_recall_accuracy`) where ``cases`` holds them."""
    from . import lines, needle, passage_recall

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
    if "passage_recall" in cases:
        found["passage_recall"] = passage_recall.passage_recall_accuracy(model, cases["passage_recall"], batch_size)
    return found


def check_gate(config: Population, run: RunFolder, spec: Pretrained) -> dict:
    """Lines accuracy of ``spec`` at its gate's length; raises (after recording it) when below the gate."""
    path = ("eval", "gates", f"{spec.name}.json")
    if not run.has(*path):
        model, tokenizer = load_member(model_folder(run, spec.name), device_of(config))
        found = lines_result(model, tokenizer, read_cases(run, gate_cases_name(spec.gate.length)), config)
        found.update(model=spec.name, gate=dataclasses.asdict(spec.gate))
        found["passed"] = found["accuracy"] >= spec.gate.min_accuracy
        run.write_json(found, *path)
    record = run.read_json(*path)
    run.log(f"{spec.name}: gate lines accuracy {record['accuracy']:.3f} at {spec.gate.length} tokens")
    if not record["passed"]:
        raise ValueError(
            f"{spec.name} fails its gate: lines accuracy {record['accuracy']:.3f} at {spec.gate.length} tokens is below "
            f"{spec.gate.min_accuracy} (recorded in {run.path(*path)}); the population cannot be measured with it, so "
            "the run stops here: train it longer or change the plan. A trained model and its gate record are kept "
            f"and not redone, so to train it again move {model_folder(run, spec.name)} and that record aside first."
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


def extended_config(config: Population, base_folder: str, extension, length: int | None = None):
    """B's config extended by ``extension`` to ``length`` positions (default ``data.length``), and the
    attention to load it with."""
    from transformers import AutoConfig

    from longce.context_extension import apply_context_extension

    model_config = AutoConfig.from_pretrained(base_folder)
    # NTK-aware scaling's base comes from the model's own base and head dimension
    attention = apply_context_extension(
        model_config,
        extension.method,
        factor=extension.factor,
        rope_theta=extension.rope_theta,
        eabf_base_length=extension.eabf_base_length or 4096,
    )
    # ABF and NTK change only the base: the positions the model may read become L.
    model_config.max_position_embeddings = max(model_config.max_position_embeddings, length or config.data.length)
    return model_config, attention or "sdpa"


# ------------------------------------------------------------------ key-token caches and calibration


def evaluator_cache(
    config: Population,
    run: RunFolder,
    evaluator: str,
    window: Window,
    documents: str,
    folder_of_model: str | None = None,
    max_length: int | None = None,
) -> str:
    """The key-token cache of ``data/<documents>.jsonl`` by ``evaluator`` with ``window`` (built once):
    the model ``models/<evaluator>``, or the one in ``folder_of_model`` (``evaluator`` then only names
    the cache), reading documents of up to ``max_length`` tokens (default ``data.length``)."""
    name = f"{evaluator}-K{window.trunc_len}-d{window.sliding_window}-{documents}"
    folder = os.path.dirname(run.path("caches", name, "x"))
    if not os.path.isfile(os.path.join(folder, "dataset_info.json")):
        source = run.path("data", f"{documents}.jsonl")
        if not os.path.isfile(source):
            raise ValueError(f"No documents at {source}: run the 'data' stage first.")
        # longppl-score's own main (what the command runs), in this process: no second start-up
        from longppl.cache.key_token_cache import compact_cache
        from longppl.tools import compute_key_tokens

        model = folder_of_model or model_folder(run, evaluator)
        arguments = ["--corpus", source, "--evaluator", model, "--output", folder]
        arguments += ["--device", device_of(config), "--trunc-len", str(window.trunc_len)]
        length = max_length or config.data.length
        arguments += ["--sliding-window", str(window.sliding_window), "--max-length", str(length)]
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


# ------------------------------------------------------------------ command line


def parse_stages(value: str, stages: tuple[str, ...]) -> list[str]:
    """The stages named in ``value`` (comma separated; ``all``: every one but ``export``), in the
    order of ``stages`` (the calling pipeline's ``STAGES``: every pipeline's command line has this form)."""
    names = [s.strip() for s in value.split(",") if s.strip()]
    if names == ["all"]:
        return [s for s in stages if s != "export"]
    unknown = [s for s in names if s not in stages]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown stages {unknown or value!r}; choose from {', '.join(stages)} or all")
    return [s for s in stages if s in names]
