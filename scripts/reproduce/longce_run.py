"""The one-command reproduction of "LongCE beats CE" at small scale (paper Section 5).

    python scripts/reproduce_longce.py --config configs/reproduce/longce_h200.yaml \\
        --corpus books/train.jsonl.gz --validation-corpus books/validation.jsonl.gz --output-dir repro-longce/

takes a model trained at a short context (a member of the config's family, trained here by
``longppl_reproduce.family``, or a trained model folder: ``base_model``), extends its context to the
evaluation length ``L`` with ``longce.apply_context_extension`` (PI, ABF or YaRN), and fine-tunes
copies of it on the training books plus LongEval "lines" documents with ``LongCETrainer``, at equal
steps and on the same token sequences, by each method of ``finetune.methods``:

- ``ce``: plain cross-entropy (``longce_plain_ce=True``), the baseline;
- ``self``: LongCE, the model being trained scores each batch (``longce_weights="self"``, the paper's);
- ``cache``: LongCE with the weights of a frozen evaluator (``evaluator``: a family member or a model
  folder), scored once into a key-token cache by ``longppl-score`` and added to the dataset by
  ``longce.add_key_token_weights`` (``longce_weights="cache"``),

each for every seed of ``finetune.seeds``. Every ``finetune.eval_every`` steps a run measures its
lines accuracy per record length (the curve of accuracy against steps); at the end, lines accuracy,
PPL and LongPPL with the evaluator's key tokens (``longppl-evaluate`` on the validation documents'
cache, hard and ``--soft``), and the step time of each method.

Stages (``--stages``, comma separated, or ``all``), each resumable as in ``longppl_reproduce.longppl_run``
(whose machinery this extends: config checks, tokenizer, data, the family's training, lines cases and
accuracy, the key-token cache and ``longppl-evaluate``):

- ``tokenizer``: trained on the books (as ``reproduce``), or the ``base_model`` folder's tokenizer.
- ``data``: as ``reproduce``, plus lines training documents at ``L`` and ``data/finetune.jsonl``: the
  fine-tuning sequences (``finetune.steps`` x sequences per step, each at most ``L`` tokens), one pool
  shared by every method and seed (a seed shuffles it), so the evaluator scores the corpus once.
- ``train``: the family members (``models/<name>/``), when the base or the evaluator is one of them.
- ``extend``: the base model with its context extended -> ``models/extended/``.
- ``cache``: the evaluator's key-token caches of the fine-tuning pool (for ``cache``) and of the
  validation documents (for LongPPL) -> ``caches/``.
- ``finetune``: one run per method and seed -> ``models/<method>-s<seed>/`` (``training.json`` holds the
  step times and the accuracy curve; a folder holding it is finished and never retrained). The pool with
  the evaluator's weights (``cache``) is built once for all seeds -> ``data/finetune-cache-weights/``.
- ``evaluate``: lines accuracy (``eval/lines/``; also of the base before the extension, at the lengths
  within its positions: ``eval/lines/base.json``), PPL and LongPPL (``eval/evaluator/``, ``eval/evaluator-soft/``).
- ``report``: ``results.json``, ``report.md``, ``figures/accuracy_vs_steps.png`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

from longppl.atomic_files import replace_directory_atomically, write_file_atomically
from longppl.settings import DEFAULT_GAMMA, require_finite, require_int
from longppl.tools.cli import command_line, run_command, tool_parser

from . import longppl_run
from .longppl_run import Run, _jsonable, _merge, _number, _totals, read_json, resolve_config_path, write_jsonl

STAGES = ("tokenizer", "data", "train", "extend", "cache", "finetune", "evaluate", "report")
#: The fine-tuning methods and the ``LongCEConfig`` fields that select them.
METHODS = {
    "ce": {"longce_plain_ce": True},
    "self": {"longce_weights": "self"},
    "cache": {"longce_weights": "cache"},
}
#: ``apply_context_extension``'s methods that a saved model keeps through its config alone (EABF also
#: needs an attention function registered in every process that loads it, so it is left out here).
EXTENSIONS = ("pi", "abf", "yarn")
#: The folder of the extended base model (a name no fine-tuning run or family member may take).
EXTENDED = "extended"
DEFAULTS = _merge(
    longppl_run.DEFAULTS,
    {
        "family": [],
        "extension": {"method": "pi", "factor": None, "rope_theta": None},
        "finetune": {
            "methods": list(METHODS),
            "seeds": [0],
            "warmup_steps": 0,
            "min_lr_ratio": 0.1,
            "weight_decay": 0.0,
            "micro_batch_tokens": None,
            "lines_share": 0.0,
            "gamma": DEFAULT_GAMMA,
            "eval_cases": None,
            "log_every": 10,
        },
    },
)


# ------------------------------------------------------------------ config


def run_name(method: str, seed: int) -> str:
    """The folder (and label) of one fine-tuning run."""
    return f"{method}-s{seed}"


def _model_folder_config(path: str) -> dict | None:
    """The ``config.json`` of a model folder, ``None`` when ``path`` is not one."""
    file = os.path.join(path, "config.json")
    return read_json(file) if os.path.isfile(file) else None


def _positions(model_config: dict) -> int | None:
    text = model_config.get("text_config") or model_config
    return text.get("max_position_embeddings")


def load_config(
    path: str,
    corpus: str | None = None,
    validation_corpus: str | None = None,
    base_model: str | None = None,
    evaluator: str | None = None,
) -> dict:
    """``longppl_run.load_config`` with this pipeline's defaults and checks (:func:`check_config`);
    ``base_model`` and ``evaluator`` (a family member or a model folder) override the config's."""

    def check(config: dict, where: str) -> None:
        for key, value in (("base_model", base_model), ("evaluator", evaluator)):
            if value:
                config[key] = value
            names = [m.get("name") for m in config.get("family") or [] if isinstance(m, dict)]
            if isinstance(config.get(key), str) and config[key] not in names:
                config[key] = resolve_config_path(config[key], where)
        check_config(config, where)

    return longppl_run.load_config(path, corpus, validation_corpus, defaults=DEFAULTS, check=check)


def check_config(config: dict, path: str) -> None:
    """Refuse a config that would fail late, naming the field and the value (``longppl_run.check_config``
    for the shared parts: corpus, family, evaluation lengths, K < L, ...)."""
    where = f"{path}:"
    names = [m.get("name") for m in config.get("family") or [] if isinstance(m, dict)]
    base, evaluator = config.get("base_model"), config.get("evaluator")
    if not isinstance(base, str) or not base:
        raise ValueError(
            f"{where} no base_model: name a family member trained at a short context, or a trained model folder "
            "(e.g. repro/models/ctx256-l80)."
        )

    def folder_positions(key: str, value) -> int | None:
        """The positions of a model folder named by ``key``; ``None`` for a family member."""
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where} no {key}: name a family member ({names}) or a trained model folder.")
        if value in names:
            return None
        found = _model_folder_config(value)
        if found is None:
            raise ValueError(
                f"{where} {key} = {value!r} is neither a family member ({names}) nor a model folder (no "
                f"{os.path.join(value, 'config.json')}); train it first (e.g. with longppl-reproduce) or fix the path."
            )
        if _positions(found) is None:
            raise ValueError(f"{where} {key} = {value!r}: its config.json has no max_position_embeddings.")
        return int(_positions(found))

    folders = {key: folder_positions(key, config.get(key)) for key in ("base_model", "evaluator")}
    longppl_run.check_config(config, path, empty_family=True, short_context=(base,))
    length = int(config["evaluation"]["length"])
    family = {v.name: v for v in longppl_run.variants(config)}

    def positions_of(key: str, value: str) -> int:
        found = folders[key]
        return int(family[value].model["max_position_embeddings"]) if found is None else found

    base_positions = positions_of("base_model", base)
    evaluator_positions = positions_of("evaluator", evaluator)
    if evaluator_positions < length:
        raise ValueError(
            f"{where} evaluator {evaluator!r} reads {evaluator_positions} positions, less than evaluation.length = "
            f"{length}: the evaluator scores documents of L tokens; give one trained at (or extended to) L."
        )

    extension = config["extension"]
    method = extension.get("method")
    if method not in EXTENSIONS:
        raise ValueError(
            f"{where} extension.method = {method!r} is not one of {EXTENSIONS} (longce.apply_context_extension)."
        )
    try:
        if extension.get("factor") is not None:
            factor = require_finite("extension.factor", extension["factor"])
            if factor < 1:
                raise ValueError(f"extension.factor must be >= 1 (new length / old length), got {factor}.")
            if method in ("pi", "yarn") and base_positions * factor < length:
                raise ValueError(
                    f"extension.factor = {factor} extends base_model {base!r} from {base_positions} to "
                    f"{int(base_positions * factor)} positions, less than evaluation.length = {length}: L is above "
                    f"what the extension allows. Raise the factor to {length / base_positions:g} or leave it out "
                    "(then it is L / the base's positions)."
                )
        if extension.get("rope_theta") is not None:
            require_finite("extension.rope_theta", extension["rope_theta"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where} {err}") from None

    tuning = config["finetune"]
    methods, seeds = tuning.get("methods"), tuning.get("seeds")
    if not isinstance(methods, list) or not methods:
        raise ValueError(f"{where} finetune.methods must be a non-empty list of {list(METHODS)}, got {methods!r}.")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or len(set(methods)) != len(methods):
        raise ValueError(
            f"{where} finetune.methods = {methods}: each must be one of {list(METHODS)} ('ce': plain cross-entropy, "
            "'self': LongCE scored by the model trained, 'cache': LongCE with the evaluator's weights), once"
            + (f"; unknown: {unknown}." if unknown else ".")
        )
    if not isinstance(seeds, list) or not seeds or len(set(map(repr, seeds))) != len(seeds):
        raise ValueError(f"{where} finetune.seeds must be a non-empty list of distinct integers, got {seeds!r}.")
    try:
        for seed in seeds:
            require_int("finetune.seeds[...]", seed, minimum=0)
        for key in ("steps", "batch_tokens", "eval_every"):
            require_int(f"finetune.{key}", tuning.get(key))
        require_int("finetune.warmup_steps", tuning["warmup_steps"], minimum=0)
        if tuning["micro_batch_tokens"] is not None:
            require_int("finetune.micro_batch_tokens", tuning["micro_batch_tokens"])
        if tuning["eval_cases"] is not None:
            require_int("finetune.eval_cases", tuning["eval_cases"])
        lr = require_finite("finetune.lr", tuning.get("lr"))
        share = require_finite("finetune.lines_share", tuning["lines_share"])
        gamma = require_finite("finetune.gamma", tuning["gamma"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where} {err}") from None
    if not lr > 0 or not gamma > 0 or not 0 <= share <= 1:
        raise ValueError(
            f"{where} finetune.lr = {lr} and finetune.gamma = {gamma} must be > 0, finetune.lines_share = {share} "
            "in [0, 1]."
        )
    if int(tuning["batch_tokens"]) < length:
        raise ValueError(
            f"{where} finetune.batch_tokens = {tuning['batch_tokens']} is less than one sequence of evaluation.length "
            f"= {length} tokens (fine-tuning runs at L)."
        )
    taken = {run_name(m, s) for m in methods for s in seeds} | {EXTENDED}
    clash = sorted(taken & set(names))
    if clash:
        raise ValueError(f"{where} family names {clash} are taken by the fine-tuning runs' folders; rename them.")


# ------------------------------------------------------------------ the run


class LongCERun(Run):
    """The output directory of one LongCE-vs-CE reproduction: ``longppl_run.Run``'s stages plus its own."""

    def __init__(self, config: dict, output_dir: str, methods=None, seeds=None, log=print):
        """``methods`` / ``seeds``: the fine-tuning runs of this call (default: all of the config's),
        so that the runs can be split over calls of a few minutes; evaluation waits for all."""
        super().__init__(config, output_dir, None, log)
        self.tuning = config["finetune"]
        self.length = int(self.evaluation["length"])
        self.runs = [(m, int(s)) for m in self.tuning["methods"] for s in self.tuning["seeds"]]
        for what, chosen, known in (
            ("--methods", methods, self.tuning["methods"]),
            ("--seeds", seeds, self.tuning["seeds"]),
        ):
            unknown = [c for c in chosen or [] if c not in known]
            if unknown:
                raise ValueError(f"{what} names {unknown}, which are not in the config's finetune list {known}.")
        self.selected_runs = [
            (m, s) for m, s in self.runs if (not methods or m in methods) and (not seeds or s in seeds)
        ]

    def named_model(self, value: str) -> str:
        """The folder of a model the config names (``base_model``, ``evaluator``): a family member's, or the path."""
        return self.model_dir(value) if value in {v.name for v in self.family} else value

    @property
    def per_step(self) -> int:
        """Sequences of ``L`` tokens per optimizer step."""
        return max(1, int(self.tuning["batch_tokens"]) // self.length)

    @property
    def positions(self) -> int:
        """Positions of the models that read the lines cases: L, since every fine-tuned model is the base
        extended to L (``extend``) and the evaluator is checked to reach L, whatever the positions of
        the short-context base in the family."""
        return int(self.evaluation["length"])

    def lines_training_lengths(self) -> list[int]:
        found = set(super().lines_training_lengths())
        if float(self.tuning["lines_share"]) > 0:
            found.add(self.length)
        return sorted(found)

    # ---------------------------------------------------------- tokenizer
    def stage_tokenizer(self) -> None:
        base = self.config["base_model"]
        if base in {v.name for v in self.family}:
            return super().stage_tokenizer()
        folder = self.path("tokenizer")
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            self.log(f"tokenizer: {folder} exists, kept")
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        info = {"vocab_size": len(tokenizer), "from": base}

        self.save_tokenizer(tokenizer, info)
        self.log(f"tokenizer: the base model's ({base}), {len(tokenizer)} tokens")

    # ---------------------------------------------------------- data
    def stage_data(self) -> None:
        super().stage_data()
        path = self.path("data", "finetune.jsonl")
        if os.path.isfile(path):
            self.log(f"data: {path} exists, kept")
            return
        import numpy as np

        from .family import TrainingBatches, load_ragged

        tokenizer = self.tokenizer()
        books = np.load(self.path("data", "train_tokens.npy"), allow_pickle=False)
        share = float(self.tuning["lines_share"])
        pool = load_ragged(self.path("data", f"lines_train_{self.length}.npz")) if share > 0 else []
        count = int(self.tuning["steps"]) * self.per_step
        batches = TrainingBatches(books, pool, self.length, share, [int(self.config["seed"]), 2])
        texts = [self.as_text(tokenizer, row) for row in batches.sequences(count)]
        write_jsonl(path, [{"text": text} for text in texts])
        self.log(f"data: {len(texts)} fine-tuning sequences of at most {self.length} tokens ({share:.0%} lines)")

    def as_text(self, tokenizer, ids) -> str:
        """The text of a token sequence, cut so that it tokenizes back into at most ``L`` tokens.

        The fine-tuning data is text, because the ``cache`` method's weights come from an evaluator
        that may have another tokenizer (the key-token cache is keyed by text); decoding and
        re-encoding a byte-level BPE may merge tokens differently at a few places, so a text can
        come back a token or two longer and is then cut at the offset of its ``L``-th token."""
        text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        return text if len(offsets) <= self.length else text[: offsets[self.length - 1][1]]

    def finetune_texts(self) -> list[str]:
        path = self.path("data", "finetune.jsonl")
        if not os.path.isfile(path):
            raise ValueError(f"No fine-tuning sequences at {path}: run the 'data' stage first.")
        with open(path, encoding="utf-8") as handle:
            return [json.loads(line)["text"] for line in handle if line.strip()]

    def validation_path(self) -> str:
        path = self.path("data", "validation.jsonl")
        if not os.path.isfile(path):
            raise ValueError(f"No validation documents at {path}: run the 'data' stage first.")
        return path

    # ---------------------------------------------------------- extend
    def stage_extend(self) -> None:
        from .family import TRAINING_RECORD, is_trained

        folder = self.model_dir(EXTENDED)
        if is_trained(folder):
            self._check_extension_kept(read_json(os.path.join(folder, TRAINING_RECORD)))
            self.log(f"extend: {folder} exists, kept")
            return
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from longce import apply_context_extension

        source = self.named_model(self.config["base_model"])
        if _model_folder_config(source) is None:
            raise ValueError(f"No base model at {source}: run the 'train' stage first (or fix base_model).")
        config = AutoConfig.from_pretrained(source)
        text = config.get_text_config()
        before = int(text.max_position_embeddings)
        extension = self.config["extension"]
        method, factor = extension["method"], extension.get("factor")
        if method in ("pi", "yarn") and factor is None:
            factor = max(1.0, self.length / before)  # exactly what reaches L
        apply_context_extension(config, method, factor=factor, rope_theta=extension.get("rope_theta"))
        # ABF changes only the RoPE base: the positions the model may read become L.
        text.max_position_embeddings = max(int(text.max_position_embeddings), self.length)
        model = AutoModelForCausalLM.from_pretrained(source, config=config)
        tokenizer = AutoTokenizer.from_pretrained(source)
        record = {
            "base_model": source,
            "method": method,
            "factor": factor,
            "rope_parameters": dict(getattr(text, "rope_parameters", None) or {}),
            "max_position_embeddings": {"before": before, "after": int(text.max_position_embeddings)},
        }

        def write(tmp: str) -> None:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, TRAINING_RECORD), "w", encoding="utf-8") as handle:
                json.dump(record, handle, indent=1)

        replace_directory_atomically(folder, write)
        self.log(
            f"extend: {source} by {method} (factor {factor}), {before} -> {text.max_position_embeddings} positions"
        )

    def _check_extension_kept(self, record: dict) -> None:
        """Refuse to keep an extended model made from another base or by another extension than the
        config's: every fine-tuned run and evaluation of this output directory starts from it."""
        extension = self.config["extension"]
        wanted = {"base_model": self.named_model(self.config["base_model"]), "method": extension["method"]}
        if extension.get("factor") is not None:
            wanted["factor"] = float(extension["factor"])
        found = {key: record.get(key) for key in wanted}
        if found != wanted:
            raise ValueError(
                f"{self.model_dir(EXTENDED)} was made with {found}, but the config asks for {wanted}: the fine-tuned "
                "runs and evaluations of this output directory come from that model. Use a new --output-dir for "
                "the new extension (or delete models/ and eval/ there)."
            )

    # ---------------------------------------------------------- cache
    def cache_dir(self, label: str) -> str:
        return self.path("caches", f"{label}-evaluator")

    def stage_cache(self) -> None:
        """The evaluator's key-token caches (``longppl-score``): the validation documents always
        (LongPPL), the fine-tuning pool for the ``cache`` method."""
        corpora = {"validation": self.validation_path()}
        if "cache" in self.tuning["methods"]:
            self.finetune_texts()  # a clear error when the data stage has not run
            corpora["finetune"] = self.path("data", "finetune.jsonl")
        evaluator = self.named_model(self.config["evaluator"])
        if _model_folder_config(evaluator) is None:
            raise ValueError(f"No evaluator at {evaluator}: run the 'train' stage first (or fix evaluator).")
        for label, corpus in corpora.items():
            done = self.path("caches", f"{label}.done.json")
            if os.path.isfile(done) and read_json(done) == {"evaluator": evaluator, "corpus": corpus}:
                self.log(f"cache: {self.cache_dir(label)} is complete, kept")
                continue
            self.run_tool(
                "compute_key_tokens",
                ["--corpus", corpus, "--evaluator", evaluator, "--output", self.cache_dir(label)]
                + ["--device", self.device, *self.window_flags()]
                + ["--alpha", str(self.evaluation["alpha"]), "--beta", str(self.evaluation["beta"])]
                + ["--max-length", str(self.length)]
                # this run's own cache, built by one process: the 4-7x of packing over bit-identity with N
                + ["--pack-documents"],
            )
            self.write_json(done, {"evaluator": evaluator, "corpus": corpus})

    def window_flags(self) -> list[str]:
        return [
            "--trunc-len",
            str(self.evaluation["trunc_len"]),
            "--sliding-window",
            str(self.evaluation["sliding_window"]),
        ]

    # ---------------------------------------------------------- finetune
    def lines_curve_cases(self) -> dict[int, list]:
        """The lines cases of the evaluations during fine-tuning (the first ``finetune.eval_cases`` per length)."""
        limit = self.tuning["eval_cases"]
        return {n: group[: int(limit)] if limit else group for n, group in self.lines_cases().items()}

    def lines_point(self, model, tokenizer, cases: dict[int, list], step: int) -> dict:
        import contextlib

        import torch

        on_gpu = self.device.startswith("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext():
            found = self.lines_scores(model, tokenizer, cases)
        per_length = {n: v["accuracy"] for n, v in found.items()}
        return {"step": step, "per_length": per_length, "mean": sum(per_length.values()) / len(per_length)}

    def stage_finetune(self) -> None:
        from .family import is_trained

        if not is_trained(self.model_dir(EXTENDED)):
            raise ValueError(f"No extended base model at {self.model_dir(EXTENDED)}: run the 'extend' stage first.")
        cases = self.lines_curve_cases()
        start_point = self.path("eval", "curve_start.json")
        if not os.path.isfile(start_point):  # step 0 of every curve: the extended base, before fine-tuning
            model, tokenizer = self._load(EXTENDED)
            self.write_json(start_point, self.lines_point(model, tokenizer, cases, 0))
            del model
        for method, seed in self.selected_runs:
            folder = self.model_dir(run_name(method, seed))
            if is_trained(folder):
                self.log(f"finetune: {run_name(method, seed)} is trained ({folder}), kept")
                continue
            self.finetune(method, seed, cases, read_json(start_point))

    def finetune_dataset(self, method: str, tokenizer):
        """The fine-tuning pool as ``input_ids`` of at most ``L`` tokens (the same for every method),
        with the evaluator's ``longce_weights`` for ``cache`` (computed once per run, see
        :meth:`cache_weights_dataset`)."""
        from datasets import Dataset

        if method == "cache":
            return self.cache_weights_dataset(tokenizer)

        def tokenize(batch: dict) -> dict:
            ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
            return {"input_ids": [row[: self.length] for row in ids]}

        return Dataset.from_dict({"text": self.finetune_texts()}).map(tokenize, batched=True).remove_columns(["text"])

    def cache_weights_key(self, tokenizer) -> dict:
        """What the ``cache`` method's weights dataset depends on: the evaluator, gamma, ``L``, the
        trained model's tokenizer, and the contents of the fine-tuning pool and of its key-token cache."""
        from longppl.fingerprints import file_sha256, tokenizer_fingerprint
        from longppl.key_token_cache import CHECKSUM_FILE

        def sha256_if_any(path: str) -> str | None:
            return file_sha256(path) if os.path.isfile(path) else None

        return {
            "evaluator": self.named_model(self.config["evaluator"]),
            "gamma": float(self.tuning["gamma"]),
            "length": self.length,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "finetune_sha256": sha256_if_any(self.path("data", "finetune.jsonl")),
            # the cache's own record of its files: it changes whenever the cache is rewritten
            "cache_checksums_sha256": sha256_if_any(os.path.join(self.cache_dir("finetune"), CHECKSUM_FILE)),
        }

    def cache_weights_dataset(self, tokenizer):
        """The fine-tuning pool with the evaluator's ``longce_weights`` (``longce.add_key_token_weights``),
        for the ``cache`` method: computed by the first ``cache`` run and saved to
        ``data/finetune-cache-weights/`` (atomically, with its :meth:`cache_weights_key`), then
        loaded by the other seeds and later calls; a changed key (evaluator, gamma, ``L``, ...)
        computes it again."""
        from datasets import Dataset, load_from_disk

        from longce import add_key_token_weights

        folder = self.path("data", "finetune-cache-weights")
        key_file = os.path.join(folder, "key.json")
        key = self.cache_weights_key(tokenizer)
        if os.path.isfile(key_file) and read_json(key_file) == key:
            self.log(f"finetune: LongCE weights of the pool from {folder}")
            return load_from_disk(os.path.join(folder, "dataset"))
        found = add_key_token_weights(
            Dataset.from_dict({"text": self.finetune_texts()}),
            key_tokens=self.cache_dir("finetune"),
            tokenizer=tokenizer,
            gamma=key["gamma"],
            max_length=self.length,
            # the cache keeps a changed evaluator's rows beside the old ones: take this one's
            evaluator=key["evaluator"],
            add_special_tokens=False,  # the family's convention: no BOS, every token of a text counts
        ).remove_columns(["text"])

        def write(tmp: str) -> None:
            found.save_to_disk(os.path.join(tmp, "dataset"))
            self.write_json(os.path.join(tmp, "key.json"), key)  # last: a folder with its key is complete

        replace_directory_atomically(folder, write)
        return load_from_disk(os.path.join(folder, "dataset"))  # memory-mapped, as the later seeds get it

    def finetune(self, method: str, seed: int, cases: dict[int, list], start_point: dict) -> None:
        """One run: ``LongCETrainer`` from the extended base, the lines curve every ``eval_every`` steps,
        the time of every step; saved with its record to ``models/<method>-s<seed>/`` atomically."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, TrainerCallback

        from longce import LongCEConfig, LongCETrainer

        from .family import TRAINING_RECORD, count_parameters

        name = run_name(method, seed)
        on_gpu = self.device.startswith("cuda")
        source = self.model_dir(EXTENDED)
        tokenizer = AutoTokenizer.from_pretrained(source)
        dataset = self.finetune_dataset(method, tokenizer)
        steps, per_step = int(self.tuning["steps"]), self.per_step
        micro = int(self.tuning["micro_batch_tokens"] or self.tuning["batch_tokens"]) // self.length
        micro = max(1, min(per_step, micro))
        while per_step % micro:  # equal micro-batches, so every step sees per_step sequences
            micro -= 1
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="sdpa").to(self.device)
        scratch = self.path("work", name)
        args = LongCEConfig(
            output_dir=scratch,
            max_steps=steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=per_step // micro,
            learning_rate=float(self.tuning["lr"]),
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": float(self.tuning["min_lr_ratio"])},
            warmup_steps=int(self.tuning["warmup_steps"]),
            weight_decay=float(self.tuning["weight_decay"]),
            adam_beta2=0.95,
            max_grad_norm=1.0,
            logging_steps=max(1, int(self.tuning["log_every"])),
            save_strategy="no",
            report_to=[],
            seed=seed,
            data_seed=seed,
            bf16=on_gpu,
            use_cpu=not on_gpu,
            disable_tqdm=True,
            dataloader_num_workers=0,
            longce_trunc_len=int(self.evaluation["trunc_len"]),
            longce_sliding_window=int(self.evaluation["sliding_window"]),
            longce_gamma=float(self.tuning["gamma"]),
            longce_max_tokens_per_batch=int(self.evaluation["max_tokens_per_batch"]),
            **METHODS[method],
        )
        run, every = self, int(self.tuning["eval_every"])
        step_seconds: list[float] = []
        curve = [start_point]

        class Measure(TrainerCallback):
            """Times each optimizer step (synchronised on the GPU) and measures the lines curve between steps."""

            def on_step_begin(self, args, state, control, **kwargs):
                if on_gpu:
                    torch.cuda.synchronize()
                self.started = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kwargs):
                if on_gpu:
                    torch.cuda.synchronize()
                step_seconds.append(time.perf_counter() - self.started)
                if state.global_step % every == 0 or state.global_step == steps:
                    point = run.lines_point(model, tokenizer, cases, state.global_step)
                    curve.append(point)
                    run.log(f"  [{name}] step {state.global_step}/{steps}: lines accuracy {point['mean']:.3f}")

        trainer = LongCETrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=DataCollatorWithFlattening(),
            processing_class=tokenizer,
            callbacks=[Measure()],
        )
        self.log(f"finetune: {name} ({steps} steps x {per_step} sequences of <= {self.length} tokens)")
        start = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - start
        # the first step pays one-off costs (allocator warm-up, kernel selection): the median is the step time
        ordered = sorted(step_seconds[1:] or step_seconds)
        record = {
            "name": name,
            "method": method,
            "seed": seed,
            "settings": {key: value for key, value in args.to_dict().items() if key.startswith("longce_")},
            "parameters": count_parameters(model),
            "steps": steps,
            "sequences": steps * per_step,
            "tokens": int(sum(len(ids) for ids in dataset["input_ids"])),
            "seconds": seconds,
            "step_seconds": {
                "median": ordered[len(ordered) // 2],
                "mean": sum(ordered) / len(ordered),
                "first": step_seconds[0],
                "all": step_seconds,
            },
            "final_loss": float(result.training_loss),
            "log_history": trainer.state.log_history,
            "curve": curve,
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        }

        def write(tmp: str) -> None:
            trainer.model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, TRAINING_RECORD), "w", encoding="utf-8") as handle:
                json.dump(_jsonable(record), handle, indent=1)

        replace_directory_atomically(self.model_dir(name), write)
        shutil.rmtree(scratch, ignore_errors=True)
        self.log(
            f"finetune: {name}: {seconds:.1f}s, {record['step_seconds']['median'] * 1e3:.1f} ms a step, "
            f"final loss {record['final_loss']:.3f}, lines accuracy {curve[-1]['mean']:.3f}"
        )

    # ---------------------------------------------------------- evaluate
    def evaluated_models(self) -> list[str]:
        return [EXTENDED] + [run_name(m, s) for m, s in self.runs]

    def base_lines(self, cases: dict[int, list]) -> None:
        """Lines accuracy of the base model before the extension, at the lines lengths within its own
        positions (``eval/lines/base.json``; nothing when none is): what the model could do before
        the extension, so the report shows what the extension cost and what fine-tuning won back."""
        from longppl.loading import load_causal_lm

        path = self.path("eval", "lines", "base.json")
        if os.path.isfile(path):
            return
        source = self.named_model(self.config["base_model"])
        positions = _positions(_model_folder_config(source) or {})
        within = {n: group for n, group in cases.items() if positions and n <= positions}
        if not within:
            return
        model, tokenizer = load_causal_lm(source, self.device)
        mean = self.write_lines_accuracy(path, source, model, tokenizer, within, positions=positions)["mean_accuracy"]
        self.log(f"evaluate: the base before the extension, lines accuracy {mean:.3f} at {sorted(within)} tokens")

    def stage_evaluate(self) -> None:
        from .family import is_trained

        cases = self.lines_cases()
        self.base_lines(cases)
        names = self.evaluated_models()
        for name in names:
            if not is_trained(self.model_dir(name)):
                raise ValueError(f"Model {name!r} is not ready ({self.model_dir(name)}): run 'extend' and 'finetune'.")
            path = self.path("eval", "lines", f"{name}.json")
            if os.path.isfile(path):
                continue
            model, tokenizer = self._load(name)
            mean = self.write_lines_accuracy(path, name, model, tokenizer, cases)["mean_accuracy"]
            self.log(f"evaluate: {name} lines accuracy {mean:.3f}")
        cache = self.cache_dir("validation")
        if not os.path.isfile(self.path("caches", "validation.done.json")):
            raise ValueError(f"No validation key-token cache at {cache}: run the 'cache' stage first.")
        models = [self.model_dir(n) for n in names]
        rule = ["--alpha", str(self.evaluation["alpha"]), "--beta", str(self.evaluation["beta"])]
        for label, extra in {"evaluator": [], "evaluator-soft": ["--soft", "--gamma", str(DEFAULT_GAMMA)]}.items():
            out = self.path("eval", label)
            done = os.path.join(out, "results.json")
            found = read_json(done) if os.path.isfile(done) else None
            if (
                found
                and [r["model"] for r in found["results"]] == models
                and found["meta"]["key_tokens"] == cache
                and os.path.getmtime(done) > os.path.getmtime(self.path("caches", "validation.done.json"))
            ):
                self.log(f"evaluate: {done} is up to date, kept")
                continue
            self.run_tool(
                "evaluate_models",
                ["--key-tokens", cache, "--evaluator", self.named_model(self.config["evaluator"])]
                + ["--models", *models, "--output-dir", out, "--device", self.device]
                + ["--no-progress", *self.window_flags(), *rule, *extra],
            )

    # ---------------------------------------------------------- report
    def stage_report(self) -> dict:
        names = self.evaluated_models()
        lines = {n: read_json(self.path("eval", "lines", f"{n}.json")) for n in names}
        by_path = {self.model_dir(n): n for n in names}
        measured = {}
        for label in ("evaluator", "evaluator-soft"):
            for row in read_json(self.path("eval", label, "results.json"))["results"]:
                entry = measured.setdefault(by_path[row["model"]], {})
                if label == "evaluator":
                    entry.update({"longppl": _number(row["longppl"]), "ppl": _number(row["ppl"]), **_totals(row)})
                else:
                    entry["soft_longppl"] = _number(row["longppl"])
        lengths = list(lines[EXTENDED]["per_length"])
        runs = []
        for name in names:
            record = read_json(os.path.join(self.model_dir(name), "training.json"))
            row = {
                "name": name,
                # the extended base is step 0 of every method: no fine-tuning, no seed
                "method": "none" if name == EXTENDED else record["method"],
                "seed": None if name == EXTENDED else record["seed"],
                "accuracy": {n: lines[name]["per_length"][n]["accuracy"] for n in lengths},
                "mean_accuracy": lines[name]["mean_accuracy"],
                **measured[name],
            }
            if name != EXTENDED:
                row.update(
                    {
                        "step_seconds": record["step_seconds"]["median"],
                        "seconds": record["seconds"],
                        "steps": record["steps"],
                        "tokens": record["tokens"],
                        "final_loss": _number(record["final_loss"]),
                        "curve": record["curve"],
                        "device": record["device"],
                    }
                )
            runs.append(row)
        summary = {}
        for method in self.tuning["methods"]:
            mine = [r for r in runs if r["method"] == method]
            keys = [*(f"accuracy.{n}" for n in lengths), "mean_accuracy", "ppl", "longppl", "soft_longppl"]
            keys.append("step_seconds")
            summary[method] = {"seeds": [r["seed"] for r in mine]} | {
                key: _spread([_field(r, key) for r in mine]) for key in keys
            }
        figures = self.path("figures")
        os.makedirs(figures, exist_ok=True)
        drawn = draw_curves(os.path.join(figures, "accuracy_vs_steps.png"), runs)
        timings = read_json(self.path("timings.json")) if os.path.isfile(self.path("timings.json")) else {}
        results = {
            "command": command_line("longppl-reproduce-longce"),
            "config": self.config,
            "seeds": {"run": self.config["seed"], "finetune": list(self.tuning["seeds"])},
            "device": next((r["device"] for r in runs if "device" in r), None),
            "base_model": self.named_model(self.config["base_model"]),
            "evaluator": self.named_model(self.config["evaluator"]),
            "extension": read_json(os.path.join(self.model_dir(EXTENDED), "training.json")),
            "base_lines": _base_lines_summary(self.path("eval", "lines", "base.json")),
            "lengths": lengths,
            "runs": runs,
            "summary": summary,
            "timings": {"stages": timings},
            "figures": drawn,
        }
        self.write_json(self.path("results.json"), _jsonable(results))
        write_file_atomically(self.path("report.md"), lambda handle: handle.write(format_report(results)))
        self.log(f"report: {self.path('results.json')}, {self.path('report.md')}, {len(drawn)} figure(s)")
        return results


# ------------------------------------------------------------------ report helpers


def _field(row: dict, key: str) -> float:
    if key.startswith("accuracy."):
        return row["accuracy"][key.split(".", 1)[1]]
    return row[key]


def _spread(values: list[float]) -> dict:
    """Mean and sample standard deviation (0 for one value) over the finite ``values``, and how many."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    mean = sum(finite) / len(finite)
    var = sum((v - mean) ** 2 for v in finite) / (len(finite) - 1) if len(finite) > 1 else 0.0
    return {"mean": mean, "std": math.sqrt(var), "n": len(finite)}


def _base_lines_summary(path: str) -> dict | None:
    """``{"positions", "accuracy": {length: fraction}}`` of ``eval/lines/base.json``, ``None`` without it."""
    if not os.path.isfile(path):
        return None
    found = read_json(path)
    return {"positions": found["positions"], "accuracy": {n: v["accuracy"] for n, v in found["per_length"].items()}}


def draw_curves(path: str, runs: list[dict]) -> list[str]:
    """Mean lines accuracy against fine-tuning steps, one line per run (a colour per method); returns
    the files written (none, with a message, without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "reproduce_longce: matplotlib is not installed, so the accuracy-against-steps plot is not drawn "
            "(pip install matplotlib); results.json holds the curves.",
            file=sys.stderr,
        )
        return []
    colours = {}
    figure, axis = plt.subplots(figsize=(6, 4))
    for row in runs:
        if "curve" not in row:
            continue
        colour = colours.setdefault(row["method"], f"C{len(colours)}")
        steps = [p["step"] for p in row["curve"]]
        axis.plot(steps, [p["mean"] for p in row["curve"]], color=colour, alpha=0.8, marker="o", markersize=3)
    for method, colour in colours.items():
        axis.plot([], [], color=colour, label=method)
    axis.set_xlabel("fine-tuning step")
    axis.set_ylabel("lines accuracy (mean over lengths)")
    axis.set_ylim(-0.02, 1.02)  # a fraction: autoscaling would blow one right answer in 150 up to a spike
    axis.legend(title="method")
    figure.tight_layout()
    write_file_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=120), binary=True)
    plt.close(figure)
    return [path]


def _fmt(value, digits: int = 2) -> str:
    return longppl_run._fmt(value, digits)


def _pm(entry: dict, digits: int = 2) -> str:
    return _fmt(entry["mean"], digits) + (f" ± {_fmt(entry['std'], digits)}" if entry["n"] > 1 else "")


def format_report(results: dict) -> str:
    """The Markdown report of ``results.json``: every run, then each method's mean ± std over seeds."""
    lengths = results["lengths"]
    extension = results["extension"]
    # the measured columns of both tables
    measures = " | ".join(f"lines {n}" for n in lengths) + " | mean | PPL | LongPPL | soft LongPPL | step ms |"
    out = ["# LongCE vs CE at small scale", ""]
    out += [
        f"Device: {results['device']}. Base model: `{results['base_model']}`, extended by {extension['method']} "
        f"(factor {extension['factor']}) from {extension['max_position_embeddings']['before']} to "
        f"{extension['max_position_embeddings']['after']} positions. Evaluator (cache weights and LongPPL): "
        f"`{results['evaluator']}`. Seeds: {results['seeds']['finetune']}.",
        "",
        "```",
        results["command"],
        "```",
        "",
        "## Runs",
        "",
        "| run | method | seed | " + measures,
        "|---|---|---|" + "---|" * (len(lengths) + 5),
    ]
    for row in results["runs"]:
        step = row.get("step_seconds")
        out.append(
            f"| {row['name']} | {row['method']} | {row['seed'] if row['seed'] is not None else '-'} | "
            + " | ".join(_fmt(row["accuracy"][n]) for n in lengths)
            + f" | {_fmt(row['mean_accuracy'])} | {_fmt(row['ppl'])} | {_fmt(row['longppl'])} | "
            f"{_fmt(row['soft_longppl'])} | {_fmt(step * 1e3 if step is not None else None, 1)} |"
        )
    base = results.get("base_lines")
    if base:
        out += [
            "",
            f"The base before the extension ({base['positions']} positions), lines accuracy: "
            + ", ".join(f"{_fmt(value)} at {n} tokens" for n, value in base["accuracy"].items())
            + ".",
        ]
    out += [
        "",
        "## Mean ± standard deviation over seeds",
        "",
        "| method | seeds | " + measures,
        "|---|---|" + "---|" * (len(lengths) + 5),
    ]
    for method, entry in results["summary"].items():
        step = dict(entry["step_seconds"])
        step.update({k: step[k] * 1e3 for k in ("mean", "std")})
        out.append(
            f"| {method} | {len(entry['seeds'])} | "
            + " | ".join(_pm(entry[f"accuracy.{n}"]) for n in lengths)
            + f" | {_pm(entry['mean_accuracy'])} | {_pm(entry['ppl'])} | {_pm(entry['longppl'])} | "
            f"{_pm(entry['soft_longppl'])} | {_pm(step, 1)} |"
        )
    out += longppl_run.report_tail(results, "Lines accuracy against steps")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ command line


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument("--config", required=True, help="the YAML config, e.g. configs/reproduce/longce_h200.yaml")
    parser.add_argument("--output-dir", required=True, help="where every stage writes (kept between calls; required)")
    parser.add_argument(
        "--corpus", help="training books (.jsonl, .jsonl.gz, datasets dir or Hub id); overrides the config's"
    )
    parser.add_argument("--validation-corpus", help="validation books, same formats; overrides the config's")
    parser.add_argument(
        "--base-model", help="a family member or a trained model folder; overrides the config's base_model"
    )
    parser.add_argument("--evaluator", help="a family member or a model folder; overrides the config's evaluator")
    parser.add_argument("--methods", help="comma-separated fine-tuning methods to run in this call (default: all)")
    parser.add_argument("--seeds", help="comma-separated fine-tuning seeds to run in this call (default: all)")
    parser.add_argument(
        "--stages",
        type=lambda value: longppl_run.parse_stages(value, STAGES),
        default=list(STAGES),
        help=f"comma-separated stages of {', '.join(STAGES)}, or all (default: all)",
    )
    return parser


def main(argv=None, prog: str | None = None) -> dict | None:
    """Run the stages; returns ``results.json``'s content when the report stage ran."""
    args = build_parser(prog).parse_args(argv)
    config = load_config(args.config, args.corpus, args.validation_corpus, args.base_model, args.evaluator)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else None
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, got {args.seeds!r}.") from None
    run = LongCERun(config, args.output_dir, methods, seeds)
    return run.run_stages(args.stages)


def cli(argv=None) -> int:
    """The ``longppl-reproduce-longce`` command: :func:`main`, with bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
