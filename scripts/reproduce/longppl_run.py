"""The one-command reproduction of the paper's LongPPL claims at small scale.

    python scripts/reproduce_longppl.py --config configs/reproduce/family_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro/

trains a family of small Llama-style LMs from scratch (``longppl_reproduce.family``), then measures
per model the LongEval "lines" accuracy per record length, and PPL and LongPPL on long validation
documents, with (a) one evaluator for all (the family's best model on lines, or the one the config
names) through the key-token cache, and (b) each model as its own evaluator; the Pearson and
Spearman correlations of PPL and of LongPPL with lines accuracy and the paper's Figure 1(b)
scatter; and the answer-token identification of the paper's Figure 5(b) (LSD alone vs LSD + LCL).
Everything lands in ``--output-dir``: ``results.json`` (which the report is built from),
``report.md``, ``figures/`` and the intermediate files below.

Stages (``--stages``, comma separated, or ``all``), each resumable: what a stage writes is written
atomically, and work already done is skipped, so a long run can be split into calls of a few
minutes on a machine that keeps the output directory between calls.

- ``tokenizer``: a byte-level BPE on the first ``tokenizer.train_books`` training books -> ``tokenizer/``.
- ``data``: the training books as one token array, validation documents of exactly
  ``evaluation.length`` tokens, lines training documents per training length, lines test cases per
  record length -> ``data/``.
- ``train``: every variant of the family (or ``--models``) -> ``models/<name>/``; a folder holding
  ``training.json`` is finished and never retrained; one holding only ``checkpoint/``
  (``training.save_every``) resumes from it.
- ``evaluate``: per model, lines accuracy and self-evaluated LongPPL -> ``eval/lines/``,
  ``eval/self/``; once every model has them, the evaluator's key-token cache
  (``longppl-score`` -> ``caches/``), all models against it with lines accuracy as
  the benchmark (``longppl-evaluate`` -> ``eval/evaluator/``, and with ``--soft`` ->
  ``eval/evaluator-soft/``: the soft LongPPL stays defined when no token passes the hard rule, as
  with small evaluators) and the answer tokens (``eval/answer_tokens.json``).
- ``report``: ``results.json``, ``report.md`` and the figures.

The two commands run as subprocesses of this interpreter (``python -m longppl.tools...``): the
reproduction goes through exactly the path users take. Every seed is in the config and recorded in ``results.json``, with the wall time
of every stage (summed over the calls that did work) and of every model's training.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import gzip
import json
import math
import os
import re
import subprocess
import sys
import time

from longppl.atomic_files import replace_directory_atomically, write_file_atomically
from longppl.settings import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_GAMMA,
    KeyTokenSettings,
    WindowSettings,
    require_bool,
    require_finite,
    require_int,
)
from longppl.tools.cli import command_line, run_command, tool_parser
from longppl.tools.correlation import undefined_because

#: The two rules of the answer-token analysis (``answer_tokens.RULES``, which imports torch).
RULES = ("lsd", "lsd+lcl")
STAGES = ("tokenizer", "data", "train", "evaluate", "report")
#: With ``data.lines_questions: fill``, the share of a training document its record takes (uniform).
FILL_RECORD_SHARE = (0.1, 0.6)
EVALUATOR_CHOICES = "auto (the model with the best mean lines accuracy) or the name of a family member"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: Settings a config may leave out. The model family's base and the sizes of the smoke test's
#: config are in configs/reproduce/; these are the parts that rarely change.
DEFAULTS = {
    "seed": 0,
    "device": "auto",
    "text_column": "text",
    "tokenizer": {"vocab_size": 8192, "train_books": 40},
    "data": {"max_books": None, "validation_share": 0.1, "lines_documents": 2048, "lines_questions": 1},
    "model": {"architecture": "llama"},
    "training": {
        "micro_batch_tokens": None,
        "warmup_steps": 20,
        "min_lr_ratio": 0.1,
        "weight_decay": 0.1,
        "lines_share": 0.0,
        "log_every": 20,
        "compile": False,  # eager: torch.compile pays only where a model trains for minutes
        "save_every": None,  # no checkpoints while a model trains
    },
    "evaluation": {
        "alpha": DEFAULT_ALPHA,
        "beta": DEFAULT_BETA,
        "evaluator": "auto",
        "max_new_tokens": 16,
        "batch_size": 8,
        "answer_token_cases": 50,
        "max_tokens_per_batch": 32768,
    },
}


# ------------------------------------------------------------------ config


def _merge(base: dict, override: dict) -> dict:
    """``base`` with ``override``'s keys replacing its own (nested dicts merged key by key)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(merged.get(key), dict) and isinstance(value, dict) else value
        )
    return merged


def resolve_config_path(value: str | None, config_path: str) -> str | None:
    """A corpus path from the config, made absolute against the config file's folder (absolute paths,
    URLs and names without a path separator that exist nowhere, i.e. Hub dataset ids, unchanged)."""
    if value is None or os.path.isabs(value) or "://" in value:
        return value
    candidate = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(config_path)), value))
    return candidate if os.path.exists(candidate) or value.startswith(".") else value


def load_config(
    path: str,
    corpus: str | None = None,
    validation_corpus: str | None = None,
    *,
    defaults: dict | None = None,
    check=None,
) -> dict:
    """The config file with the defaults filled in and the command line's corpora applied, checked.

    ``defaults`` (default :data:`DEFAULTS`) and ``check(config, path)`` (default :func:`check_config`)
    let a pipeline built on this one (``reproduce_longce``) add its own settings and checks.

    Raises:
        ValueError: naming the file, the field and the value that is wrong (see :func:`check_config`).
    """
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"No config file at {path!r}.")
    with open(path, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config is a YAML mapping, got {type(raw).__name__}.")
    config = _merge(DEFAULTS if defaults is None else defaults, raw)
    config["corpus"] = corpus or resolve_config_path(config.get("corpus"), path)
    config["validation_corpus"] = validation_corpus or resolve_config_path(config.get("validation_corpus"), path)
    (check_config if check is None else check)(config, path)
    return config


def variants(config: dict):
    """The family as :class:`longppl_reproduce.family.Variant` objects (base settings + each one's overrides)."""
    from .family import Variant

    found = []
    for member in config["family"]:
        training = _merge(config["training"], member.get("training") or {})
        training.setdefault("seed", config["seed"])
        found.append(Variant(member["name"], _merge(config["model"], member.get("model") or {}), training))
    return found


def check_config(config: dict, path: str, *, empty_family: bool = False, short_context=()) -> None:
    """Refuse a config that would fail late (or give meaningless numbers), naming the field and value.

    Args:
        empty_family: accept a family of no model (a pipeline that takes its models from elsewhere).
        short_context: names of family members read at ``evaluation.length`` only after a context
            extension (``reproduce_longce``): their ``max_position_embeddings`` may be below it.
    """
    where = f"{path}:"
    if not config.get("corpus"):
        raise ValueError(f"{where} no training corpus: set 'corpus' in the config or pass --corpus.")
    family = config.get("family")
    if not isinstance(family, list) or not (family or empty_family):
        raise ValueError(f"{where} 'family' must be a non-empty list of models (each with a 'name'), got {family!r}.")
    names = []
    for index, member in enumerate(family):
        if (
            not isinstance(member, dict)
            or not isinstance(member.get("name"), str)
            or not _NAME.fullmatch(member["name"])
        ):
            raise ValueError(
                f"{where} family[{index}] needs a 'name' of letters, digits, '.', '_' or '-' (it names a folder), "
                f"got {member!r}."
            )
        unknown = set(member) - {"name", "model", "training", "description"}
        if unknown:
            raise ValueError(
                f"{where} family[{index}] ({member['name']}) has unknown keys {sorted(unknown)}; "
                "use 'model', 'training' and 'description'."
            )
        names.append(member["name"])
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where} family names must be unique; {twice} appear more than once.")

    evaluation = config["evaluation"]
    try:
        length = require_int("evaluation.length", evaluation.get("length"), minimum=2)
        window = WindowSettings(evaluation.get("trunc_len"), evaluation.get("sliding_window"))
        require_finite("evaluation.alpha", evaluation["alpha"])
        require_finite("evaluation.beta", evaluation["beta"])
        for key in ("lines_cases", "validation_documents", "max_new_tokens", "batch_size", "answer_token_cases"):
            require_int(f"evaluation.{key}", evaluation.get(key))
        lines_lengths = evaluation.get("lines_lengths")
        if not isinstance(lines_lengths, list) or not lines_lengths:
            raise ValueError(
                f"evaluation.lines_lengths must be a non-empty list of token counts, got {lines_lengths!r}."
            )
        for value in lines_lengths:
            require_int("evaluation.lines_lengths[...]", value, minimum=16)
        require_int("tokenizer.vocab_size", config["tokenizer"]["vocab_size"], minimum=300)
        require_int("tokenizer.train_books", config["tokenizer"]["train_books"])
        require_int("data.lines_documents", config["data"]["lines_documents"])
        if config["data"]["lines_questions"] != "fill":
            require_int("data.lines_questions", config["data"]["lines_questions"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where} {err}") from None
    if window.trunc_len >= length:
        raise ValueError(
            f"{where} evaluation.trunc_len (K) = {window.trunc_len} must be smaller than evaluation.length = "
            f"{length}: with K >= the document length no token has a short-context score, so there are no key "
            "tokens. Lower K (a quarter of the length keeps most of a record out of the short context)."
        )
    if max(lines_lengths) > length:
        raise ValueError(
            f"{where} evaluation.lines_lengths {lines_lengths} go past evaluation.length = {length}; "
            "the lines records must fit the length the models are evaluated at."
        )
    if evaluation["evaluator"] != "auto" and evaluation["evaluator"] not in names:
        raise ValueError(f"{where} evaluation.evaluator = {evaluation['evaluator']!r} is not {EVALUATOR_CHOICES}.")
    for variant in variants(config):
        training = variant.training
        try:
            for key in ("seq_len", "steps", "batch_tokens", "seed"):
                require_int(f"training.{key}", training.get(key), minimum=0 if key == "seed" else 1)
            require_finite("training.lr", training.get("lr"))
            share = require_finite("training.lines_share", training["lines_share"])
            require_bool("training.compile", training.get("compile"))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where} model {variant.name!r}: {err}") from None
        if not 0 <= share <= 1:
            raise ValueError(f"{where} model {variant.name!r}: training.lines_share must be in [0, 1], got {share}.")
        if training.get("save_every") is not None:
            try:
                require_int("training.save_every", training["save_every"])
            except (ValueError, TypeError) as err:
                raise ValueError(
                    f"{where} model {variant.name!r}: {err} (or leave it out for no checkpoints)"
                ) from None
        positions = variant.model.get("max_position_embeddings")
        if positions is None:
            raise ValueError(f"{where} model {variant.name!r} sets no model.max_position_embeddings.")
        for what, value in (("evaluation.length", length), ("training.seq_len", training["seq_len"])):
            if value > positions and not (what == "evaluation.length" and variant.name in short_context):
                raise ValueError(
                    f"{where} {what} = {value} exceeds model {variant.name!r}'s max_position_embeddings = "
                    f"{positions}; raise model.max_position_embeddings or lower {what}."
                )
        if evaluation["max_new_tokens"] >= positions // 2:
            raise ValueError(
                f"{where} evaluation.max_new_tokens = {evaluation['max_new_tokens']} leaves too little of model "
                f"{variant.name!r}'s max_position_embeddings = {positions} for a lines prompt (the prompts are shortened "
                "so that prompt and generated answer fit the positions): keep it under half of the positions."
            )


# ------------------------------------------------------------------ corpus


def read_books(source: str, text_column: str = "text") -> list[str]:
    """The texts of a corpus: a ``.jsonl`` or ``.jsonl.gz`` file (one JSON object per line), or what
    ``longppl.tools.corpus.read_documents`` reads (a datasets directory, a Hub dataset id).

    Raises:
        ValueError: an empty corpus, a line that is not an object with a non-empty ``text_column``.
    """
    if source.endswith(".jsonl.gz"):
        if not os.path.isfile(source):
            raise ValueError(f"No gzipped JSONL file at {source!r}.")
        texts = []
        with gzip.open(source, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                text = record.get(text_column) if isinstance(record, dict) else None
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(
                        f"{source}, line {number}: no non-empty string field {text_column!r} "
                        f"(fields: {sorted(record) if isinstance(record, dict) else type(record).__name__})."
                    )
                texts.append(text)
    else:
        from longppl.tools.corpus import read_documents

        texts = read_documents(source, text_column)
    if not texts:
        raise ValueError(f"The corpus {source!r} holds no documents: give a corpus with texts in {text_column!r}.")
    return texts


def training_and_validation_books(config: dict) -> tuple[list[str], list[str]]:
    """``(training books, validation books)``: the validation corpus when given, else the last
    ``data.validation_share`` of the training corpus (at least one book), held out of training."""
    books = read_books(config["corpus"], config["text_column"])
    if config["data"]["max_books"]:
        books = books[: int(config["data"]["max_books"])]
    if config["validation_corpus"]:
        return books, read_books(config["validation_corpus"], config["text_column"])
    if len(books) < 2:
        raise ValueError(
            f"The corpus {config['corpus']!r} holds {len(books)} document; without --validation-corpus at least "
            "2 are needed (the last ones are held out for validation)."
        )
    held = max(1, int(round(len(books) * float(config["data"]["validation_share"]))))
    return books[:-held], books[-held:]


# ------------------------------------------------------------------ the run


class Run:
    """The output directory of one reproduction and the work of its stages."""

    def __init__(self, config: dict, output_dir: str, models: list[str] | None = None, log=print):
        self.config, self.out, self.log = config, os.path.abspath(output_dir), log
        self.family = variants(config)
        known = [v.name for v in self.family]
        unknown = [m for m in models or [] if m not in known]
        if unknown:
            raise ValueError(f"--models names {unknown}, which are not in the config's family {known}.")
        self.selected = [v for v in self.family if not models or v.name in models]
        self.evaluation = config["evaluation"]
        os.makedirs(self.out, exist_ok=True)

    # paths
    def run_stages(self, stages: list[str]) -> dict | None:
        """Run ``stages`` in order (each ``stage_<name>``), recording each one's wall time; returns the
        last stage's value (``results.json``'s content when it is ``report``)."""
        results = None
        for stage in stages:
            start = time.perf_counter()
            self.log(f"== stage {stage}")
            results = getattr(self, f"stage_{stage}")()
            self.record_time(stage, time.perf_counter() - start)
        return results

    def path(self, *parts: str) -> str:
        return os.path.join(self.out, *parts)

    def model_dir(self, name: str) -> str:
        return self.path("models", name)

    @property
    def device(self) -> str:
        import torch

        wanted = self.config["device"]
        return ("cuda" if torch.cuda.is_available() else "cpu") if wanted == "auto" else wanted

    def tokenizer(self):
        from transformers import AutoTokenizer

        folder = self.path("tokenizer")
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise ValueError(f"No tokenizer in {folder}: run the 'tokenizer' stage first (--stages tokenizer).")
        return AutoTokenizer.from_pretrained(folder)

    def write_json(self, path: str, value) -> None:
        write_file_atomically(path, lambda handle: json.dump(value, handle, indent=1))

    def record_time(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to the stage's total in ``timings.json`` (a stage may take several calls)."""
        path = self.path("timings.json")
        timings = read_json(path) if os.path.isfile(path) else {}
        entry = timings.setdefault(stage, {"seconds": 0.0, "calls": 0})
        entry["seconds"] += seconds
        entry["calls"] += 1
        self.write_json(path, timings)

    # ---------------------------------------------------------- tokenizer
    def stage_tokenizer(self) -> None:
        from .family import train_tokenizer

        folder = self.path("tokenizer")
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            self.log(f"tokenizer: {folder} exists, kept")
            return
        books, _ = training_and_validation_books(self.config)
        settings = self.config["tokenizer"]
        sample = books[: int(settings["train_books"])]
        start = time.perf_counter()
        tokenizer = train_tokenizer(sample, int(settings["vocab_size"]))
        seconds = time.perf_counter() - start
        chars = sum(len(t) for t in sample)
        tokens = sum(len(ids) for ids in tokenizer(sample, add_special_tokens=False)["input_ids"])
        info = {
            "vocab_size": len(tokenizer),
            "train_books": len(sample),
            "seconds": seconds,
            "chars_per_token": chars / max(1, tokens),
        }

        self.save_tokenizer(tokenizer, info)
        self.log(f"tokenizer: {info['vocab_size']} tokens from {len(sample)} books in {seconds:.1f}s")

    def save_tokenizer(self, tokenizer, info: dict) -> None:
        """``tokenizer`` and ``tokenizer_info.json`` (``info``) into ``tokenizer/``, atomically."""

        def write(tmp: str) -> None:
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, "tokenizer_info.json"), "w", encoding="utf-8") as handle:
                json.dump(info, handle, indent=1)

        replace_directory_atomically(self.path("tokenizer"), write)

    # ---------------------------------------------------------- data
    def stage_data(self) -> None:
        from . import lines
        from .family import cut_documents, encode_stream, save_ragged, save_token_array, token_dtype

        tokenizer = self.tokenizer()
        folder = self.path("data")
        os.makedirs(folder, exist_ok=True)
        seed = int(self.config["seed"])
        books = None
        if not os.path.isfile(os.path.join(folder, "train_tokens.npy")) or not os.path.isfile(
            os.path.join(folder, "validation.jsonl")
        ):
            books, validation = training_and_validation_books(self.config)
            start = time.perf_counter()
            stream = encode_stream(tokenizer, books)
            save_token_array(os.path.join(folder, "train_tokens.npy"), stream)
            self.log(
                f"data: {len(books)} training books, {stream.shape[0]:,} tokens ({time.perf_counter() - start:.1f}s)"
            )
            length = int(self.evaluation["length"])
            documents = cut_documents(tokenizer, validation, length, int(self.evaluation["validation_documents"]))
            if not documents:
                raise ValueError(
                    f"No validation book is {length} tokens long (evaluation.length): give longer validation "
                    "texts or a shorter evaluation.length."
                )
            write_jsonl(os.path.join(folder, "validation.jsonl"), [{"text": text} for text in documents])
            self.log(f"data: {len(documents)} validation documents of {length} tokens")
        # lines documents for training, one pool per training length of the models that use them
        for seq_len in self.lines_training_lengths():
            path = os.path.join(folder, f"lines_train_{seq_len}.npz")
            if os.path.isfile(path):
                continue
            import numpy as np

            questions = self.config["data"]["lines_questions"]
            rng = np.random.default_rng([seed, seq_len])
            count = int(self.config["data"]["lines_documents"])
            if questions == "fill":
                texts = self.filled_lines_documents(tokenizer, rng, seq_len, count)
                shape = (
                    f"records of {FILL_RECORD_SHARE[0]:.0%}-{FILL_RECORD_SHARE[1]:.0%} of the sequence, then questions"
                )
            else:
                num_lines = self.training_lines(tokenizer, seq_len, int(questions), seed)
                texts = [lines.lines_training_document(rng, num_lines, int(questions)) for _ in range(count)]
                shape = f"{num_lines} lines"
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            eos = tokenizer.eos_token_id
            # A filled document may run a few tokens over: cutting its tail drops only its last questions.
            arrays = [np.asarray([eos, *row[: seq_len - 2], eos]) for row in ids]
            save_ragged(path, arrays, token_dtype(len(tokenizer)))
            self.log(f"data: {len(arrays)} lines training documents ({shape}) for seq_len {seq_len}")
        # lines test cases, one file per record length, in LongEval's JSONL format (read back by lines.read_lines_cases)
        for length in self.evaluation["lines_lengths"]:
            path = os.path.join(folder, f"lines_{length}.jsonl")
            if os.path.isfile(path):
                continue
            cases, longest = self.lines_test_cases(tokenizer, int(length))
            write_jsonl(path, [case_record(case) for case in cases])
            self.log(
                f"data: {len(cases)} lines cases of {cases[0].num_lines} lines (~{length} tokens; the longest "
                f"prompt and answer take {longest} of the models' {self.positions} positions)"
            )

    @property
    def positions(self) -> int:
        """The fewest positions of the family's models (``model.max_position_embeddings``)."""
        return min(int(v.model["max_position_embeddings"]) for v in self.family)

    def lines_test_cases(self, tokenizer, length: int) -> tuple[list, int]:
        """``evaluation.lines_cases`` lines test cases of about ``length`` tokens (prompt and reference
        answer, :func:`lines.lines_for_token_length`), and the most positions one of them takes:
        ``max(prompt + max_new_tokens, prompt + answer)`` tokens.

        The greedy answer is generated after the prompt, so where that passes the models' positions
        (``length`` near ``max_position_embeddings`` and ``max_new_tokens`` longer than the reference
        answer), the records lose lines until every case fits: a model is never asked to read or
        write past its positions. Cases that fit are the ones ``length`` alone gives.
        """
        from . import lines

        seed, count = int(self.config["seed"]), int(self.evaluation["lines_cases"])
        new, positions = int(self.evaluation["max_new_tokens"]), self.positions
        num_lines = lines.lines_for_token_length(tokenizer, min(length, positions), seed=seed)

        def tokens(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=True)["input_ids"])

        while True:
            cases = lines.generate_lines_cases(num_lines, count, seed + length)
            longest = max(max(tokens(c.prompt) + new, tokens(lines.case_text(c))) for c in cases)
            if longest <= positions:
                return cases, longest
            if num_lines == 1:
                raise ValueError(
                    f"A one-line lines case and evaluation.max_new_tokens = {new} take {longest} tokens, more than "
                    f"the models' max_position_embeddings = {positions}: lower evaluation.max_new_tokens."
                )
            # longest / num_lines overstates a line's tokens (the header counts too): this drops about
            # the lines the overflow takes, rarely more, and one at a time near the limit.
            num_lines -= max(1, (longest - positions) * num_lines // longest)

    def lines_training_lengths(self) -> list[int]:
        """The sequence lengths that need a pool of lines training documents (``data/lines_train_<n>.npz``)."""
        return sorted({int(v.training["seq_len"]) for v in self.family if v.training["lines_share"] > 0})

    @staticmethod
    def filled_lines_documents(tokenizer, rng, seq_len: int, count: int) -> list[str]:
        """``count`` lines training documents for ``seq_len`` (``data.lines_questions: fill``): each a record
        taking a uniform share in :data:`FILL_RECORD_SHARE` of about 90% of the sequence, then as many
        questions with their answers as fit (at most one per line).

        Why: with one or a few questions per record, the tokens that need retrieval (the asked line's name
        and number in each answer) are under 1% of a document, and small models trained for a minute
        never learn the task; filling the rest of the sequence with questions (13 on average at 2048 tokens)
        makes about 5% of them retrieval targets, and records of varied length are a curriculum of distances.
        """
        import numpy as np

        from . import lines

        def tokens(num_lines: int, questions: int) -> int:
            text = lines.lines_training_document(np.random.default_rng(0), num_lines, questions)
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])

        per_line = (tokens(80, 1) - tokens(40, 1)) / 40
        per_question = (tokens(80, 21) - tokens(80, 1)) / 20
        header = tokens(40, 1) - 40 * per_line - per_question
        budget = 0.9 * seq_len
        documents = []
        for _ in range(count):
            share = rng.uniform(*FILL_RECORD_SHARE)
            num_lines = int(np.clip(share * budget / per_line, 2, lines.MAX_LINES))
            questions = int((budget - header - num_lines * per_line) // per_question)
            questions = max(1, min(num_lines, questions))
            documents.append(lines.lines_training_document(rng, num_lines, questions))
        return documents

    @staticmethod
    def training_lines(tokenizer, seq_len: int, questions: int, seed: int) -> int:
        """Lines of a training record whose document (record, ``questions`` questions and answers)
        takes about 90% of ``seq_len`` tokens: the rest is book text before it, and a document never
        overflows its sequence (a cut record would ask about lines it no longer holds)."""
        import numpy as np

        from . import lines

        target = int(seq_len * 0.9)
        num_lines = lines.lines_for_token_length(tokenizer, target, seed=seed)
        while True:  # the questions add tokens that lines_for_token_length does not count
            num_lines = max(questions, min(num_lines, lines.MAX_LINES))
            sample = lines.lines_training_document(np.random.default_rng(seed), num_lines, questions)
            length = len(tokenizer(sample, add_special_tokens=False)["input_ids"])
            if length <= target or num_lines == questions:
                break
            num_lines = min(num_lines - 1, int(num_lines * target / length))
        if length > seq_len - 2:
            raise ValueError(
                f"A lines training document of {questions} questions needs {length} tokens, more than training "
                f"seq_len {seq_len}: lower data.lines_questions or raise the seq_len."
            )
        return num_lines

    # ---------------------------------------------------------- train
    def stage_train(self) -> None:
        import numpy as np

        from .family import TrainingBatches, is_trained, load_ragged, train_variant

        tokenizer = self.tokenizer()
        books = None
        for variant in self.selected:
            folder = self.model_dir(variant.name)
            if is_trained(folder):
                self.log(f"train: {variant.name} is trained ({folder}), kept")
                continue
            if books is None:
                path = self.path("data", "train_tokens.npy")
                if not os.path.isfile(path):
                    raise ValueError(f"No training tokens at {path}: run the 'data' stage first.")
                books = np.load(path, allow_pickle=False)
            seq_len = int(variant.training["seq_len"])
            pool = []
            if variant.training["lines_share"] > 0:
                pool_path = self.path("data", f"lines_train_{seq_len}.npz")
                if not os.path.isfile(pool_path):
                    raise ValueError(f"No lines training documents at {pool_path}: run the 'data' stage first.")
                pool = load_ragged(pool_path)
            batches = TrainingBatches(
                books, pool, seq_len, float(variant.training["lines_share"]), [int(variant.training["seed"]), 1]
            )
            self.log(f"train: {variant.name} ({variant.model.get('architecture', 'llama')}, seq_len {seq_len})")
            record = train_variant(variant, tokenizer, batches, folder, self.device, self.log)
            self.log(
                f"train: {variant.name}: {record['parameters'] / 1e6:.1f}M parameters, {record['tokens']:,} tokens "
                f"in {record['seconds']:.1f}s ({record['tokens_per_second'] / 1e6:.2f}M tok/s), "
                f"final loss {record['final_loss']:.3f}"
            )

    # ---------------------------------------------------------- evaluate
    def _load(self, name: str):
        from longppl.loading import load_causal_lm

        return load_causal_lm(self.model_dir(name), self.device)

    def lines_cases(self) -> dict[int, list]:
        from . import lines

        cases = {}
        for length in self.evaluation["lines_lengths"]:
            path = self.path("data", f"lines_{length}.jsonl")
            if not os.path.isfile(path):
                raise ValueError(f"No lines cases at {path}: run the 'data' stage first.")
            cases[int(length)] = lines.read_lines_cases(path)
        return cases

    def lines_scores(self, model, tokenizer, cases: dict[int, list]) -> dict[str, dict]:
        """Lines accuracy of ``model`` per record length: ``{str(length): {accuracy, correct, total, outputs}}``."""
        from . import lines

        accuracy = {}
        for length, group in cases.items():
            found = lines.lines_accuracy(
                model,
                tokenizer,
                group,
                max_new_tokens=int(self.evaluation["max_new_tokens"]),
                batch_size=int(self.evaluation["batch_size"]),
            )
            accuracy[str(length)] = {
                "accuracy": found["accuracy"],
                "correct": found["correct"],
                "total": found["total"],
                "outputs": found["outputs"],  # the greedy answers, to see how a model fails
            }
        return accuracy

    def write_lines_accuracy(
        self, path: str, model_name: str, model, tokenizer, cases: dict[int, list], **extra
    ) -> dict:
        """Score ``cases`` (:meth:`lines_scores`) and write ``{"model", **extra, "per_length",
        "mean_accuracy"}`` to ``path`` (the record the reports read); returns it."""
        accuracy = self.lines_scores(model, tokenizer, cases)
        record = {"model": model_name, **extra, "per_length": accuracy}
        record["mean_accuracy"] = sum(v["accuracy"] for v in accuracy.values()) / len(accuracy)
        self.write_json(path, record)
        return record

    def evaluate_model(self, name: str, cases: dict[int, list], texts: list[str]) -> None:
        """Lines accuracy per length, and PPL / LongPPL with the model as its own evaluator."""
        from longppl.scoring import (
            document_results,
            score_with_evaluator,
            score_with_model,
            summarize_results,
            text_key_weights,
        )

        lines_path, self_path = self.path("eval", "lines", f"{name}.json"), self.path("eval", "self", f"{name}.json")
        if os.path.isfile(lines_path) and os.path.isfile(self_path):
            self.log(f"evaluate: {name} has its lines accuracy and self-evaluation, kept")
            return
        model, tokenizer = self._load(name)
        start = time.perf_counter()
        if not os.path.isfile(lines_path):
            accuracy = self.write_lines_accuracy(lines_path, name, model, tokenizer, cases)["per_length"]
            self.log(
                f"evaluate: {name} lines accuracy "
                + ", ".join(f"{k}: {v['accuracy']:.2f}" for k, v in accuracy.items())
            )
        if not os.path.isfile(self_path):
            # (b): the model is its own evaluator; the scoring core is the metric's and the cache's.
            settings = KeyTokenSettings(self.evaluation["trunc_len"], self.evaluation["sliding_window"])
            budget = int(self.evaluation["max_tokens_per_batch"])
            evaluator_scores = score_with_evaluator(
                model,
                tokenizer,
                texts,
                max_tokens_per_batch=budget,
                progress=False,
                per_document=True,
                settings=settings,
            )
            model_scores = score_with_model(model, tokenizer, texts, budget, progress=False)
            alpha, beta = self.evaluation["alpha"], self.evaluation["beta"]
            weights = text_key_weights(texts, evaluator_scores, model_scores, alpha, beta)
            result = summarize_results(document_results(model_scores, weights))
            soft_weights = text_key_weights(
                texts, evaluator_scores, model_scores, alpha, beta, soft=True, gamma=DEFAULT_GAMMA
            )
            soft = summarize_results(document_results(model_scores, soft_weights), soft=True)
            self.write_json(
                self_path,
                {"model": name, "longppl": result["longppl"], "ppl": result["ppl"], **_totals(result)}
                | {"soft_longppl": soft["longppl"]},
            )
            self.log(f"evaluate: {name} self-evaluated LongPPL {result['longppl']:.2f}, PPL {result['ppl']:.2f}")
        self.write_json(self.path("eval", "seconds", f"{name}.json"), {"seconds": time.perf_counter() - start})

    def choose_evaluator(self) -> str:
        chosen = self.evaluation["evaluator"]
        if chosen != "auto":
            return chosen
        means = {v.name: read_json(self.path("eval", "lines", f"{v.name}.json"))["mean_accuracy"] for v in self.family}
        # ties go to the earlier family member, so the choice does not depend on float noise of the rest
        return max(means, key=lambda name: (means[name], -list(means).index(name)))

    def run_tool(self, module: str, arguments: list[str]) -> None:
        """Run a command-line tool (``longppl.tools.<module>``, the code of ``longppl-score`` /
        ``longppl-evaluate``) in a fresh process of this interpreter, exactly as a user runs it."""
        command = [sys.executable, "-m", f"longppl.tools.{module}", *arguments]
        self.log("$ " + " ".join(command))
        finished = subprocess.run(command, check=False)
        if finished.returncode != 0:
            raise RuntimeError(
                f"longppl.tools.{module} failed (exit status {finished.returncode}); its messages are above."
            )

    def stage_evaluate(self) -> None:
        validation = self.path("data", "validation.jsonl")
        if not os.path.isfile(validation):
            raise ValueError(f"No validation documents at {validation}: run the 'data' stage first.")
        with open(validation, encoding="utf-8") as handle:
            texts = [json.loads(line)["text"] for line in handle if line.strip()]
        cases = self.lines_cases()
        from .family import is_trained

        for variant in self.selected:
            if not is_trained(self.model_dir(variant.name)):
                raise ValueError(
                    f"Model {variant.name!r} is not trained yet ({self.model_dir(variant.name)}): run 'train'."
                )
            self.evaluate_model(variant.name, cases, texts)
        waiting = [v.name for v in self.family if not os.path.isfile(self.path("eval", "self", f"{v.name}.json"))]
        if waiting:
            self.log(f"evaluate: the family-level evaluation waits for {waiting} (evaluate them with --models)")
            return
        self.evaluate_family(validation, cases)

    def evaluate_family(self, validation: str, cases: dict[int, list]) -> None:
        """(a): one evaluator's key-token cache, every model against it with lines accuracy as the
        benchmark score; and the answer-token identification with that evaluator."""
        evaluator = self.choose_evaluator()
        self.write_json(
            self.path("eval", "evaluator.json"), {"evaluator": evaluator, "rule": self.evaluation["evaluator"]}
        )
        models = [self.model_dir(v.name) for v in self.family]
        scores = self.path("eval", "benchmark_scores.csv")
        rows = [
            (self.model_dir(v.name), read_json(self.path("eval", "lines", f"{v.name}.json"))["mean_accuracy"])
            for v in self.family
        ]
        write_file_atomically(
            scores, lambda handle: csv.writer(handle).writerows([("model", "score"), *rows]), newline=""
        )
        cache = self.path("caches", f"evaluator-{evaluator}")
        # The hard rule (the paper's LongPPL) and the soft weights min(exp(LSD), gamma) (its Table 2):
        # the soft variant is defined even where no token passes LSD > alpha, as with weak evaluators.
        runs = {"evaluator": [], "evaluator-soft": ["--soft", "--gamma", str(DEFAULT_GAMMA)]}
        pending = {}
        for label, extra in runs.items():
            out = self.path("eval", label)
            done = os.path.join(out, "results.json")
            found = read_json(done) if os.path.isfile(done) else None
            if found and [r["model"] for r in found["results"]] == models and found["meta"]["key_tokens"] == cache:
                self.log(f"evaluate: {done} is up to date, kept")
            else:
                pending[out] = extra
        if pending:
            window = [
                "--trunc-len",
                str(self.evaluation["trunc_len"]),
                "--sliding-window",
                str(self.evaluation["sliding_window"]),
            ]
            rule = ["--alpha", str(self.evaluation["alpha"]), "--beta", str(self.evaluation["beta"])]
            self.run_tool(
                "compute_key_tokens",
                [
                    "--corpus",
                    validation,
                    "--evaluator",
                    self.model_dir(evaluator),
                    "--output",
                    cache,
                    "--device",
                    self.device,
                ]
                + window
                + rule
                + ["--max-length", str(self.evaluation["length"])],
            )
            for out, extra in pending.items():
                self.run_tool(
                    "evaluate_models",
                    ["--key-tokens", cache, "--models", *models, "--benchmark-scores", scores]
                    + ["--benchmark-name", "lines accuracy", "--output-dir", out, "--device", self.device]
                    + ["--no-progress", *window, *rule, *extra],
                )
        self.answer_tokens(evaluator, cases)

    def answer_tokens(self, evaluator: str, cases: dict[int, list]) -> None:
        """Figure 5(b): answer tokens (the digits of the number) vs the other answer-side tokens, by
        LSD alone and by LSD + LCL, scored by the evaluator on lines prompts followed by their answer."""
        path = self.path("eval", "answer_tokens.json")
        if os.path.isfile(path) and read_json(path)["evaluator"] == evaluator:
            self.log(f"evaluate: {path} exists, kept")
            return
        import numpy as np

        from . import answer_tokens

        per_length = max(1, int(self.evaluation["answer_token_cases"]) // len(cases))
        chosen = [case for group in cases.values() for case in group[:per_length]]
        model, tokenizer = self._load(evaluator)
        window = WindowSettings(self.evaluation["trunc_len"], self.evaluation["sliding_window"])
        scored = answer_tokens.answer_token_scores(model, tokenizer, chosen, window=window)
        alpha, beta = float(self.evaluation["alpha"]), float(self.evaluation["beta"])
        lsd, lcl, is_answer = (np.asarray(scored[key]) for key in ("lsd", "lcl", "is_answer"))
        found = answer_tokens.classify_answer_tokens(lsd, lcl, is_answer, alpha=alpha, beta=beta)
        # The paper's setting: the asked line lies beyond the short context (K = 4096 of 32k there;
        # here K is a quarter of L, so many asked lines are within it and their LSD is ~0 by definition).
        far = ~is_answer | scored["beyond_short"]
        beyond = answer_tokens.classify_answer_tokens(lsd[far], lcl[far], is_answer[far], alpha=alpha, beta=beta)
        keys = ("lsd", "lcl", "is_answer", "beyond_short")
        arrays = {key: np.asarray(scored[key], dtype=np.float64) for key in keys}
        write_file_atomically(
            self.path("eval", "answer_token_scores.npz"), lambda handle: np.savez(handle, **arrays), binary=True
        )
        self.write_json(
            path,
            {
                "evaluator": evaluator,
                "cases": len(chosen),
                "alpha": alpha,
                "beta": beta,
                "tokens": int(arrays["lsd"].size),
                "answer_tokens": int(arrays["is_answer"].sum()),
                "answer_tokens_beyond_short": int(beyond["n_answer"]),
                "classification": found,
                "classification_beyond_short": beyond,
            },
        )
        for label, result in (("all answer tokens", found), ("numbers beyond the short context", beyond)):
            self.log(
                f"evaluate: answer tokens ({label}), balanced accuracy "
                + ", ".join(f"{rule}: {result[rule]['balanced_accuracy']:.3f}" for rule in answer_tokens.RULES)
            )

    # ---------------------------------------------------------- report
    def stage_report(self) -> dict:
        from longppl.tools.correlation import pearson, spearman

        from .family import TRAINING_RECORD

        family = []
        for variant in self.family:
            record = read_json(os.path.join(self.model_dir(variant.name), TRAINING_RECORD))
            model = variant.model
            family.append(
                {
                    "name": variant.name,
                    "description": next(
                        (m.get("description", "") for m in self.config["family"] if m["name"] == variant.name), ""
                    ),
                    "architecture": model.get("architecture", "llama"),
                    "sliding_window": model.get("sliding_window"),
                    "rope_theta": model.get("rope_theta"),
                    "seq_len": variant.training["seq_len"],
                    "lines_share": variant.training["lines_share"],
                    "seed": variant.training["seed"],
                    **{
                        k: record[k]
                        for k in (
                            "parameters",
                            "steps",
                            "tokens",
                            "seconds",
                            "tokens_per_second",
                            "final_loss",
                            "device",
                        )
                    },
                }
            )
        lines = {v.name: read_json(self.path("eval", "lines", f"{v.name}.json")) for v in self.family}
        accuracy = {name: value["mean_accuracy"] for name, value in lines.items()}
        evaluated = read_json(self.path("eval", "evaluator", "results.json"))
        evaluator = read_json(self.path("eval", "evaluator.json"))["evaluator"]
        by_path = {self.model_dir(v.name): v.name for v in self.family}
        soft = {
            row["model"]: _number(row["longppl"])
            for row in read_json(self.path("eval", "evaluator-soft", "results.json"))["results"]
        }
        with_evaluator = {
            by_path[row["model"]]: {"longppl": _number(row["longppl"]), "ppl": _number(row["ppl"]), **_totals(row)}
            | {"soft_longppl": soft[row["model"]]}
            for row in evaluated["results"]
        }
        own = {v.name: read_json(self.path("eval", "self", f"{v.name}.json")) for v in self.family}
        own = {
            name: {**value} | {key: _number(value[key]) for key in ("longppl", "ppl", "soft_longppl")}
            for name, value in own.items()
        }
        names = [v.name for v in self.family]
        # Each view correlates one LongPPL (hard or soft, evaluator (a) or self (b)) and PPL with the
        # mean lines accuracy, over the models where both are defined (hard LongPPL is NaN without key tokens).
        views = {
            "evaluator": (with_evaluator, "longppl"),
            "evaluator_soft": (with_evaluator, "soft_longppl"),
            "self": (own, "longppl"),
            "self_soft": (own, "soft_longppl"),
        }
        correlations, scatters = {}, []
        for label, (values, measure) in views.items():
            used = [n for n in names if math.isfinite(values[n][measure]) and math.isfinite(values[n]["ppl"])]
            x = {"longppl": [values[n][measure] for n in used], "ppl": [values[n]["ppl"] for n in used]}
            y = [accuracy[n] for n in used]
            correlations[label] = {"models": used} | {
                metric: {"pearson": pearson(x[metric], y), "spearman": spearman(x[metric], y)} for metric in x
            }
            scatters.append((label, used, x["longppl"], x["ppl"], y))
        figures = self.path("figures")
        os.makedirs(figures, exist_ok=True)
        drawn = draw_figures(figures, scatters, self.path("eval", "answer_token_scores.npz"), self.evaluation["alpha"])
        timings = read_json(self.path("timings.json")) if os.path.isfile(self.path("timings.json")) else {}
        answer = read_json(self.path("eval", "answer_tokens.json"))
        results = {
            "command": command_line("longppl-reproduce"),
            "config": self.config,
            "seeds": {"run": self.config["seed"], **{v.name: v.training["seed"] for v in self.family}},
            "device": family[0]["device"] if family else None,
            "tokenizer": read_json(self.path("tokenizer", "tokenizer_info.json")),
            "family": family,
            "lines": lines,
            "evaluator": evaluator,
            "with_evaluator": with_evaluator,
            "self_evaluated": own,
            "correlations": correlations,
            "answer_tokens": answer,
            "timings": {
                "stages": timings,
                "training_seconds": {f["name"]: f["seconds"] for f in family},
                "evaluation_seconds": {
                    n: read_json(self.path("eval", "seconds", f"{n}.json"))["seconds"]
                    for n in names
                    if os.path.isfile(self.path("eval", "seconds", f"{n}.json"))
                },
            },
            "figures": drawn,
        }
        write_file_atomically(self.path("results.json"), lambda handle: json.dump(_jsonable(results), handle, indent=1))
        write_file_atomically(self.path("report.md"), lambda handle: handle.write(format_report(results)))
        self.log(f"report: {self.path('results.json')}, {self.path('report.md')}, {len(drawn)} figures")
        return results


# ------------------------------------------------------------------ helpers


def read_json(path: str):
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def write_jsonl(path: str, records: list[dict]) -> None:
    write_file_atomically(path, lambda handle: handle.writelines(json.dumps(r) + "\n" for r in records))


def case_record(case) -> dict:
    """A lines case as a JSON object with LongEval's fields (``prompt``, ``expected_number``) and ours."""
    record = dataclasses.asdict(case) if dataclasses.is_dataclass(case) else dict(vars(case))
    return {key: value for key, value in record.items() if value is not None}


def _number(value) -> float:
    """JSON's null (how the scripts write NaN) back to NaN."""
    return float("nan") if value is None else float(value)


def _totals(result: dict) -> dict:
    key, tokens = result.get("n_key_tokens"), result.get("n_tokens")
    if isinstance(key, list):
        key, tokens = sum(key), sum(tokens)
    return {"key_tokens": float(key), "tokens": int(tokens)}


def _jsonable(value):
    """``value`` with NaN / infinities as ``None`` (JSON has no NaN) and NumPy scalars as Python numbers."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def draw_figures(folder: str, scatters: list, answer_scores: str, alpha: float) -> list[str]:
    """The Figure 1(b) scatters and the answer tokens' LSD histogram; returns the files written.

    Args:
        scatters: ``(label, models, longppl, ppl, accuracy)`` per view; views of fewer than 2
            models are not drawn.
    Without matplotlib, a message says so and no figure is drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "reproduce: matplotlib is not installed, so no figures are drawn (pip install matplotlib).", file=sys.stderr
        )
        return []
    import numpy as np

    from longppl.tools.figures import correlation_scatter

    from .answer_tokens import answer_lsd_histogram

    drawn = []
    for label, models, longppl, ppl, accuracy in scatters:
        if len(models) < 2:
            continue
        path = os.path.join(folder, f"correlation_{label}.png")
        correlation_scatter(path, models, longppl, ppl, accuracy, "lines accuracy")
        drawn.append(path)
    with np.load(answer_scores, allow_pickle=False) as data:
        lsd, is_answer = data["lsd"], data["is_answer"].astype(bool)
        beyond = data["beyond_short"].astype(bool) if "beyond_short" in data.files else None
    path = os.path.join(folder, "lsd_answer_tokens.png")
    answer_lsd_histogram(path, lsd, is_answer, float(alpha), beyond_short=beyond)
    drawn.append(path)
    return drawn


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def report_tail(results: dict, figures_title: str) -> list[str]:
    """The end of a run's ``report.md`` (Markdown lines): the wall time per stage, then the figures
    (``results["figures"]``, under ``## figures_title``) when any were drawn."""
    lines = ["", "## Wall time", "", "| stage | seconds | calls |", "|---|---|---|"]
    for stage, entry in results["timings"]["stages"].items():
        lines.append(f"| {stage} | {entry['seconds']:.1f} | {entry['calls']} |")
    if results["figures"]:
        lines += ["", f"## {figures_title}", ""]
        lines += [f"![{os.path.basename(p)}](figures/{os.path.basename(p)})" for p in results["figures"]]
    return lines


def format_report(results: dict) -> str:
    """The Markdown report of ``results.json``: the family, the measures, the correlations, the answer tokens."""
    lines = ["# LongPPL reproduction at small scale", ""]
    lines += [f"Device: {results['device']}. Evaluator (a): **{results['evaluator']}**.", ""]
    lines += ["```", results["command"], "```", ""]
    lines += [
        "## The family",
        "",
        "| model | arch | params | seq_len | window | RoPE base | lines share | tokens | train s | final loss |",
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|---|"]
    for f in results["family"]:
        lines.append(
            f"| {f['name']} | {f['architecture']} | {f['parameters'] / 1e6:.1f}M | {f['seq_len']} | {f['sliding_window'] or '-'} | "
            f"{f['rope_theta'] or 'default'} | {f['lines_share']:.0%} | {f['tokens']:,} | {f['seconds']:.1f} | {_fmt(f['final_loss'], 3)} |"
        )
    lengths = list(next(iter(results["lines"].values()))["per_length"]) if results["lines"] else []
    lines += [""] + [f"- **{f['name']}**: {f['description']}" for f in results["family"] if f["description"]]
    lines += ["", "## Lines accuracy, PPL and LongPPL", ""]
    # PPL does not depend on the evaluator (every model reads the same texts), so it has one column.
    lines += [
        "| model | "
        + " | ".join(f"lines {n}" for n in lengths)
        + " | mean | PPL | LongPPL (a) | soft (a) | LongPPL (b, self) | soft (b) |"
    ]
    lines += ["|---|" + "---|" * (len(lengths) + 6)]
    for f in results["family"]:
        name = f["name"]
        per = results["lines"][name]["per_length"]
        a, b = results["with_evaluator"][name], results["self_evaluated"][name]
        lines.append(
            f"| {name} | "
            + " | ".join(_fmt(per[n]["accuracy"]) for n in lengths)
            + f" | {_fmt(results['lines'][name]['mean_accuracy'])} | {_fmt(a['ppl'])} | {_fmt(a['longppl'])} | {_fmt(a['soft_longppl'])} | {_fmt(b['longppl'])} | {_fmt(b['soft_longppl'])} |"
        )
    lines += [
        "",
        "## Correlation with mean lines accuracy",
        "",
        "(a) `evaluator`: one evaluator's key tokens for every model; (b) `self`: each model its own evaluator; "
        "`_soft`: soft LongPPL (weights min(exp(LSD), gamma)); `ppl` is correlated over the same models.",
        "",
        "| evaluator | measure | Pearson | Spearman | models |",
        "|---|---|---|---|---|",
    ]
    for label, found in results["correlations"].items():
        for metric in ("longppl", "ppl"):
            lines.append(
                f"| {label} | {metric} | {_fmt(found[metric]['pearson'], 3)} | {_fmt(found[metric]['spearman'], 3)} | {len(found['models'])} |"
            )
    accuracies = {f["name"]: results["lines"][f["name"]]["mean_accuracy"] for f in results["family"]}
    reasons: dict[str, list[str]] = {}  # why a row reads n/a, with the views it holds for
    for label, found in results["correlations"].items():
        why = undefined_because({"the mean lines accuracies": [accuracies[name] for name in found["models"]]})
        if why:
            reasons.setdefault(why, []).append(f"`{label}`")
    lines += ["", *(f"n/a ({', '.join(labels)}): {why}." for why, labels in reasons.items())] if reasons else []
    answer = results["answer_tokens"]
    lines += [
        "",
        f"## Answer tokens ({answer['tokens']} tokens, {answer['answer_tokens']} answer tokens, evaluator {answer['evaluator']})",
        "",
    ]
    beyond = answer.get("classification_beyond_short")
    lines += [
        "| rule | balanced accuracy, all answer tokens | recall | specificity |"
        + (
            f" balanced accuracy, numbers beyond the short context ({answer['answer_tokens_beyond_short']} tokens) | recall |"
            if beyond
            else ""
        ),
        "|---|---|---|---|" + ("---|---|" if beyond else ""),
    ]
    for rule in RULES:
        found = answer["classification"][rule]
        row = f"| {rule} | {_fmt(found['balanced_accuracy'], 3)} | {_fmt(found['recall'], 3)} | {_fmt(found['specificity'], 3)} |"
        if beyond:
            row += f" {_fmt(beyond[rule]['balanced_accuracy'], 3)} | {_fmt(beyond[rule]['recall'], 3)} |"
        lines.append(row)
    lines += report_tail(results, "Figures")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ command line


def parse_stages(value: str, stages: tuple[str, ...] = STAGES) -> list[str]:
    """The comma-separated ``value`` as stages of ``stages`` in pipeline order (``all``: every one)."""
    names = [s.strip() for s in value.split(",") if s.strip()]
    if names == ["all"]:
        return list(stages)
    unknown = [s for s in names if s not in stages]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown stages {unknown or value!r}; choose from {', '.join(stages)} or all")
    return [s for s in stages if s in names]  # always in pipeline order


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument(
        "--config",
        required=True,
        help="the reproduction's YAML config, e.g. configs/reproduce/family_h200.yaml (required)",
    )
    parser.add_argument("--output-dir", required=True, help="where every stage writes (kept between calls; required)")
    parser.add_argument(
        "--corpus", help="training books (.jsonl, .jsonl.gz, datasets dir or Hub id); overrides the config's"
    )
    parser.add_argument(
        "--validation-corpus",
        help="validation books, same formats; overrides the config's (default: the config's, else the last books of --corpus)",
    )
    parser.add_argument(
        "--stages",
        type=parse_stages,
        default=list(STAGES),
        help=f"comma-separated stages of {', '.join(STAGES)}, or all (default: all)",
    )
    parser.add_argument(
        "--models", help="comma-separated family members to train / evaluate in this call (default: all)"
    )
    return parser


def main(argv=None, prog: str | None = None) -> dict | None:
    """Run the stages; returns ``results.json``'s content when the report stage ran."""
    args = build_parser(prog).parse_args(argv)
    config = load_config(args.config, args.corpus, args.validation_corpus)
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    run = Run(config, args.output_dir, models)
    return run.run_stages(args.stages)


def cli(argv=None) -> int:
    """The ``longppl-reproduce`` command: :func:`main`, with bad inputs (a config's wrong field, an
    empty corpus) reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
