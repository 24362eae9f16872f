"""The ``start`` stage: the tokenizer, the data, the fine-tuning pools and cases of each setting, and the
start models (given, found or trained by the population's stages).
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..common import stages
from ..common.config import Population
from ..common.run_folder import RunFolder, read_record, write_jsonl
from .config import (
    Comparison,
    Selection,
    Setting,
    chosen_settings,
    evaluator_names,
    fresh_extends,
    model_specs,
    per_step,
    pool_names,
    setting_training,
    validation_name,
)


def import_model(run: RunFolder, source: str, name: str) -> None:
    """Copy the model folder ``source`` (a population run's model or an export) into ``models/<name>``,
    with a training record saying where it came from (kept when there)."""
    import shutil

    from longppl.atomic_files import replace_directory_atomically

    from ..common.family import TRAINING_RECORD, is_trained

    target = stages.model_folder(run, name)
    if os.path.abspath(source) == target:  # the population's own run folder: the model is already here
        return
    if is_trained(target):
        record = run.read_json("models", name, TRAINING_RECORD)
        if record.get("imported_from") != source:
            origin = record.get("imported_from") or "this run's training"
            raise ValueError(
                f"{target} holds {name} from {origin}, not {source}: the runs of this output "
                "folder start from it; use another --output-dir for another model."
            )
        return

    def write(tmp: str) -> None:
        for entry in os.listdir(source):
            if os.path.isfile(os.path.join(source, entry)):
                shutil.copy2(os.path.join(source, entry), os.path.join(tmp, entry))
        record = {"name": name, "model": {}}
        if os.path.isfile(os.path.join(source, TRAINING_RECORD)):
            damaged = "give another model folder (a population run's models/<name> or its export)"
            record = read_record(os.path.join(source, TRAINING_RECORD), remedy=damaged)
        record["imported_from"] = source
        with open(os.path.join(tmp, TRAINING_RECORD), "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)

    replace_directory_atomically(target, write)
    run.log(f"start: {name} from {source}")


def import_tokenizer(run: RunFolder, source: str) -> None:
    """The tokenizer of the given B as the run's (a run's own tokenizer must be the same)."""
    from transformers import AutoTokenizer

    from longppl.atomic_files import replace_directory_atomically
    from longppl.models.fingerprints import tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(source)
    if run.has("tokenizer", "tokenizer.json"):
        if tokenizer_fingerprint(stages.load_tokenizer(run)) != tokenizer_fingerprint(tokenizer):
            raise ValueError(
                f"The tokenizer in {run.path('tokenizer')} is not the one of --base-model {source}: the data of this "
                "output folder was made with another tokenizer; use another --output-dir."
            )
        return
    replace_directory_atomically(os.path.dirname(run.path("tokenizer", "x")), tokenizer.save_pretrained)
    run.log(f"start: the tokenizer of {source}")


# ------------------------------------------------------------------ start


def stage_start(config: Comparison, pop: Population, run: RunFolder, selection=None) -> None:
    """Tokenizer, data, B, E1 (E2): given (copied in) or trained by the population's stages (with
    settings: :func:`start_settings`)."""
    if config.settings:
        return start_settings(config, pop, run, selection or Selection())
    if config.base_model:
        import_tokenizer(run, config.base_model)
    else:
        stages.stage_tokenizer(pop, run)
    stages.stage_data(pop, run)
    write_finetune_data(config, pop, run)
    if config.base_model:
        import_model(run, config.base_model, pop.base.name)
        stages.check_gate(pop, run, pop.base)
    else:
        stages.stage_base(pop, run)
    first, second = evaluator_names(config, pop)
    given = {first: config.evaluator, second: config.second_evaluator}
    specs = {spec.name: spec for spec in pop.evaluators}
    for name in (first, second):
        if name is None:
            continue
        if given[name]:
            import_model(run, given[name], name)
            if name in specs and specs[name].enabled:  # a disabled spec has no gate cases
                stages.check_gate(pop, run, specs[name])
        else:
            stages.pretrain(pop, run, specs[name])


def as_text(tokenizer, ids, length: int) -> str:
    """The text of a token sequence, cut so that it tokenizes back into at most ``length`` tokens.

    The fine-tuning data is text, because the ``cache`` method's weights come from the evaluator's
    key-token cache, which is keyed by text; decoding and re-encoding a byte-level BPE may merge
    tokens differently at a few places, so a text can come back a token or two longer and is then
    cut at the offset of its ``length``-th token."""
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text if len(offsets) <= length else text[: offsets[length - 1][1]]


def write_finetune_data(config: Comparison, pop: Population, run: RunFolder) -> None:
    """The mix's task documents, and ``data/finetune.jsonl``: ``training.steps x per_step`` sequences
    drawn once (the run's seed); a run's seed orders them (the same order for every method), and
    a run longer than ``training.steps`` (``ce-wallclock``) goes round them again."""
    if run.has("data", "finetune.jsonl"):
        return
    import numpy as np

    training, mix = config.finetune.training, config.finetune.mix
    tokenizer = stages.load_tokenizer(run)
    stream = np.load(run.path("data", "train_tokens.npy"), allow_pickle=False)
    for kind in mix.task_shares():
        stages.write_pool(pop, run, tokenizer, stream, kind, training.seq_len, mix.asked_within)
    batches = stages.batches(run, training.seq_len, mix, pop.seed)
    rows = batches.sequences(training.steps * per_step(training))
    texts = [as_text(tokenizer, row, training.seq_len) for row in rows]
    write_jsonl(run.path("data", "finetune.jsonl"), [{"text": text} for text in texts])
    run.log(f"start: {len(texts)} fine-tuning sequences of at most {training.seq_len} tokens")


def settings_data_jobs(
    config: Comparison, pop: Population, run: RunFolder, settings: list[Setting], models=None
) -> list[tuple]:
    """The files of ``settings`` (and of the ``pretrained`` models they use, or ``models``) still to
    write, as ``(kind, *arguments)``, each independent and written atomically (``settings_data_job``)."""
    jobs, has = [], lambda *parts: run.has("data", *parts)
    used = set(models or ()) | {name for s in settings for name in (s.start, s.evaluator)}
    pretrained = [spec for spec in config.pretrained if spec.name in used]
    for spec in pretrained:
        for kind in spec.mix.task_shares():
            if not has("pools", stages.pool_name(kind, spec.training.seq_len, spec.mix.asked_within)):
                jobs.append(("pool", kind, spec.training.seq_len, spec.mix.asked_within))
    starts, lengths = {spec.gate.length for spec in stages.gate_specs(pop)}, set()
    for spec in pretrained:
        if spec.gate.length not in starts | lengths and not has("cases", stages.gate_cases_name(spec.gate.length)):
            jobs.append(("gate", spec.gate.length, spec.gate.cases, spec.gate.lines))
        lengths.add(spec.gate.length)
    mix = config.finetune.mix
    for setting in settings:
        length = setting.seq_len
        if setting.start_length not in starts | lengths and not has(
            "cases", stages.gate_cases_name(setting.start_length)
        ):
            jobs.append(("gate", setting.start_length, pop.evaluation.cases, None))
        lengths.add(setting.start_length)
        for kind in mix.task_shares():
            if not has("pools", stages.pool_name(kind, length, mix.asked_within)):
                jobs.append(("pool", kind, length, mix.asked_within))
        for n in setting.lines_lengths:
            jobs += [("lines", n, None)] if not has("cases", stages.lines_cases_name(n)) else []
            if setting.beyond_start and not has("cases", stages.lines_cases_name(n, setting.start_length)):
                jobs.append(("lines", n, setting.start_length))
        if not has("cases", f"needle-{max(setting.lines_lengths)}.jsonl"):
            jobs.append(("needle", max(setting.lines_lengths)))
        if not has(f"{validation_name(pop, length)}.jsonl"):
            jobs.append(("validation", length))
        if config.recall_cases and not has("cases", f"recall-{length}.jsonl"):
            jobs.append(("recall", length))
    # the fine-tuning pools last: they read the task-document pools of the jobs above
    pools = [("finetune", s.seq_len) for s in settings if not pools_written(config, run, s.seq_len)]
    return list(dict.fromkeys(jobs)), list(dict.fromkeys(pools))  # settings of one length share their files


def settings_data_job(configs: tuple, root: str, job: tuple) -> str:
    """Write one file of :func:`settings_data_jobs` into the run folder at ``root`` (``configs``:
    ``(comparison, population)``); returns the line to log."""
    import numpy as np

    from ..common import corpus_chunks

    config, pop = configs
    run = RunFolder(root, log=lambda *_: None)
    tokenizer = stages.load_tokenizer(run)
    kind, arguments = job[0], job[1:]
    if kind == "pool":
        stream = np.load(run.path("data", "train_tokens.npy"), mmap_mode="r", allow_pickle=False)
        return stages.write_pool(pop, run, tokenizer, stream, *arguments)
    if kind == "gate":
        length, cases, num_lines = arguments
        gate = dataclasses.replace(pop.base.gate, length=length, cases=cases, lines=num_lines)
        spec = dataclasses.replace(pop.base, name=f"cases-{length}", gate=gate)
        return stages.write_gate_cases(pop, run, tokenizer, spec)
    if kind == "lines":
        return stages.write_lines_cases_beyond(pop, run, tokenizer, *arguments)
    if kind == "needle":
        return stages.write_needle_cases(pop, run, tokenizer, arguments[0])
    (length,) = arguments
    if kind == "finetune":
        write_setting_pools(config, pop, run, length)
        return f"data: the fine-tuning pools of {length} tokens"
    validation_ids = stages.book_ids(tokenizer, stages.validation_books(pop))
    if kind == "validation":
        data = pop.data
        count = max(1, data.validation_documents * data.length // length)  # the population's tokens
        documents = corpus_chunks.body_chunks(
            validation_ids,
            length,
            count,
            skip_fraction=data.skip_fraction,
            per_book_cap=data.per_book_cap,
            seed=pop.seed,
        )
        texts = tokenizer.batch_decode(documents.tolist())
        write_jsonl(run.path("data", f"{validation_name(pop, length)}.jsonl"), [{"text": t} for t in texts])
        return f"data: {len(texts)} validation documents of {length} tokens"
    return write_recall_cases(config, pop, run, validation_ids, length)


def write_recall_cases(config: Comparison, pop: Population, run: RunFolder, validation_ids: list, length: int) -> str:
    """The held-out passage-recall cases of a setting of ``length`` tokens: ``recall_cases`` cases of
    ``length - recall_margin`` tokens from the validation books, the span beyond K."""
    from ..common import passage_recall

    cases = passage_recall.passage_recall_cases(
        validation_ids,
        length - config.recall_margin,
        config.finetune.window.trunc_len,
        config.recall_cases,
        pop.seed + length,
    )
    passage_recall.write_passage_recall_cases(run.path("data", "cases", f"recall-{length}.jsonl"), cases)
    return f"data: {len(cases)} passage-recall cases of {length - config.recall_margin} tokens"


def distinct_pool(stream, documents: list, seq_len: int, share: float, count: int, seed) -> tuple:
    """``(rows [n, seq_len], document_of_row [n])``: up to ``count`` sequences, each a different
    stretch of the book stream (``stream``'s non-overlapping windows, in a random order), with
    probability ``share`` a task document of ``documents`` at its end, each document used once
    (in a random order; -1: none). Fewer than ``count`` rows when the windows or the documents run
    out: no two rows share a window or a document, so no sequence is seen twice."""
    import numpy as np

    rng = np.random.default_rng(seed)
    windows = rng.permutation(stream.shape[0] // seq_len)
    order = rng.permutation(len(documents))
    rows, used, taken = [], [], 0
    for window in windows[:count]:
        row = np.array(stream[window * seq_len : (window + 1) * seq_len], dtype=np.int64)
        document = -1
        if share > 0 and rng.random() < share:
            if taken == len(order):
                break  # no unused document left: the pool stops here
            document, taken = int(order[taken]), taken + 1
            tail = documents[document][-seq_len:]
            row[seq_len - tail.shape[0] :] = tail
        rows.append(row)
        used.append(document)
    return np.array(rows, dtype=np.int64).reshape(-1, seq_len), np.array(used, dtype=np.int64)


def write_setting_pools(config: Comparison, pop: Population, run: RunFolder, length: int) -> None:
    """``data/finetune-<L>.jsonl`` (``steps x per_step`` sequences, shared by every method of every
    setting at L) and, for ``ce-fresh``, ``data/finetune-<L>-fresh.jsonl`` (the sequences after them,
    up to ``round(fresh_factor x steps)`` steps in all, whole steps only): distinct book windows
    (:func:`distinct_pool`), 5%-style task documents each used once."""
    import numpy as np

    if pools_written(config, run, length):
        return
    main, fresh = pool_names(length)
    tuning = config.finetune
    training = setting_training(config, length)
    per, steps = per_step(training), training.steps
    total = round(tuning.fresh_factor * steps) if fresh_extends(config) else steps
    tokenizer = stages.load_tokenizer(run)
    stream = np.load(run.path("data", "train_tokens.npy"), mmap_mode="r", allow_pickle=False)
    shares = tuning.mix.task_shares()
    if len(shares) > 1:
        raise ValueError(
            "finetune.mix: the settings' pools take one kind of task document (lines or needle), not several."
        )
    kind, share = next(iter(shares.items()), ("lines", 0.0))
    documents = stages.pool(run, kind, length, tuning.mix.asked_within) if share > 0 else []
    rows, _ = distinct_pool(stream, documents, length, share, total * per, [pop.seed, length, 5])
    if rows.shape[0] < steps * per:
        raise ValueError(
            f"The training books give {rows.shape[0]} distinct sequences of {length} tokens, fewer than the "
            f"{steps * per} of {steps} fine-tuning steps: give more books or fewer steps."
        )
    texts = [as_text(tokenizer, row, length) for row in rows]
    write_jsonl(run.path("data", f"{main}.jsonl"), [{"text": t} for t in texts[: steps * per]])
    if fresh_extends(config):
        whole = (len(texts) - steps * per) // per * per  # whole steps of fresh sequences
        fresh_texts = texts[steps * per : steps * per + whole]
        write_jsonl(run.path("data", f"{fresh}.jsonl"), [{"text": t} for t in fresh_texts])
        run.log(f"start: {len(fresh_texts)} fresh sequences of {length} tokens for ce-fresh ({whole // per} steps)")
    run.log(f"start: {steps * per} fine-tuning sequences of at most {length} tokens")


def pools_written(config: Comparison, run: RunFolder, length: int) -> bool:
    main, fresh = pool_names(length)
    return run.has("data", f"{main}.jsonl") and (not fresh_extends(config) or run.has("data", f"{fresh}.jsonl"))


def start_settings(config: Comparison, pop: Population, run: RunFolder, selection) -> None:
    """The ``start`` stage of a config with settings: tokenizer and the population's data, the
    settings' cases and pools, then the models of the selected settings (their start models and
    outside evaluators; ``--models`` names others, or ``none``), each through its gate."""
    stages.stage_tokenizer(pop, run)
    stages.stage_data(pop, run)
    settings = chosen_settings(config, selection.settings)
    files, pools = settings_data_jobs(config, pop, run, settings, selection.models)
    stages.run_data_jobs((config, pop), run, files, worker=settings_data_job)
    stages.run_data_jobs((config, pop), run, pools, worker=settings_data_job)
    specs = model_specs(config, pop)
    wanted = selection.models
    if wanted is None:
        wanted = list(dict.fromkeys(n for s in settings for n in (s.start, s.evaluator)))
    for name in wanted:
        stages.pretrain(pop, run, specs[name])
