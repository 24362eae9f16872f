#!/usr/bin/env python
"""Fine-tune a causal LM with LongCE (``LongCETrainer``) from a YAML recipe.

    python scripts/train_longce.py --config configs/tiny_cpu.yaml               # CPU, seconds
    python scripts/train_longce.py --config configs/tiny_cpu.yaml --learning_rate 1e-4 --max_steps 10
    accelerate launch --config_file <accelerate.yaml> scripts/train_longce.py \\
        --config configs/setting_a_pg19_eabf.yaml                               # the paper's setting A

Every field of ``ModelArguments``, ``DataArguments`` and ``LongCEConfig`` (``TrainingArguments``
plus ``longce_*``) can be set in the YAML file and overridden on the command line; ``--help``
lists the model, data and LongCE fields, ``--help-all`` every ``TrainingArguments`` field too
(``--config recipe.yaml --help`` shows the recipe's values as the defaults). The YAML values
become the parser's defaults (as TRL's ``TrlParser`` does), so the command line always wins.
Unknown YAML keys are an error. Renamed fields take either name, on the command line or in the
recipe (``dtype`` / ``torch_dtype``, ``activation_checkpointing`` / ``gradient_checkpointing``,
see ``ALIASES``); a name given on the command line overrides the recipe's value under either.

Evaluation data (``eval_data_files``, ``eval_split`` or ``validation_split_percentage``) is
processed like the training data; ``--eval_strategy steps --eval_steps N`` then logs
``eval_loss`` and the LongCE statistics (``eval_ce_loss``, ...) every N steps.

Sequences are built either run_clm-style (documents tokenized, joined with EOS, cut into
``max_seq_length`` blocks) or, with ``packing: true``, per document (each document, EOS
appended, cut into pieces of at most ``max_seq_length`` tokens) and flattened into one row per
batch by ``DataCollatorWithFlattening``: position ids restart at every piece, so no attention and
no LongCE short-context window crosses a document.

``resume_from_checkpoint`` takes a checkpoint folder, or ``last`` for the newest
``checkpoint-*`` folder of ``output_dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields, make_dataclass, replace
from itertools import chain
from typing import Any, get_type_hints

import datasets
import torch
import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorWithFlattening,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

try:
    from longce import LongCEConfig, LongCETrainer, apply_context_extension
    from longce.context_extension import METHODS
except ImportError:  # a checkout without `pip install`
    sys.exit("install the project first: pip install -e .")

BYTE_LEVEL = "byte-level"
DATA_FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
    ".csv": "csv",
}
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Two names of one field (the first is the current transformers name): either works, in the recipe or
# on the command line; the dataclasses refuse both names with different values.
ALIASES = (
    ("dtype", "torch_dtype"),
    ("activation_checkpointing", "gradient_checkpointing"),
    ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"),
)
# Shown by --help besides ModelArguments and DataArguments (--help-all: every LongCEConfig field).
LONGCE_PREFIX = "longce_"


@dataclass
class ModelArguments:
    """Which model and tokenizer to train, its context extension and its LoRA adapter."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub id or local folder of a pretrained causal LM. Exactly one of this and model_config."},
    )
    model_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Build a randomly initialised model from this config instead: a mapping with 'model_type' "
            "(e.g. 'llama') and config keyword arguments (a JSON string on the command line). vocab_size and "
            "bos/eos/pad token ids default to the tokenizer's."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": f"Hub id or local folder of the tokenizer (default: model_name_or_path), or "
            f"'{BYTE_LEVEL}': a tokenizer built in code with one token per byte (ids 0-255) plus <s>=256, "
            "</s>=257, <pad>=258; it prepends <s>."
        },
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of the model weights: auto (the checkpoint's; float32 for model_config), float32, "
            "bfloat16 or float16; unset means auto. Mixed precision is set apart with bf16 / fp16.",
            "choices": list(DTYPES),
        },
    )
    torch_dtype: str | None = field(
        default=None,
        metadata={"help": "Same as dtype (its name before transformers 5); give one of them.", "choices": list(DTYPES)},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention implementation (sdpa, eager, flash_attention_2, ...); default: transformers'. "
            "context_extension 'eabf' brings its own and cannot be combined with another."
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Cache folder for downloaded models, tokenizers and datasets."},
    )
    context_extension: str = field(
        default="none",
        metadata={
            "help": "RoPE context extension applied to the config before the model is built: none, pi "
            "(positions divided by rope_factor), abf (rope_theta), yarn (rope_factor, "
            "original_max_position_embeddings) or eabf (rope_theta plus attention scaling with "
            "eabf_base_length).",
            "choices": list(METHODS),
        },
    )
    rope_factor: float | None = field(
        default=None,
        metadata={"help": "PI / YaRN scaling factor: new context length / pre-training context length."},
    )
    rope_theta: float | None = field(
        default=None,
        metadata={"help": "ABF / EABF RoPE base (default 500000)."},
    )
    original_max_position_embeddings: int | None = field(
        default=None,
        metadata={"help": "YaRN: the pre-training context length (default: the config's)."},
    )
    eabf_base_length: int = field(
        default=4096,
        metadata={"help": "EABF: queries at position p are scaled by max(1, log(p + 1) / log(eabf_base_length))."},
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains all weights (no adapter)."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata={"help": "Names of the modules that get a LoRA adapter."},
    )

    def __post_init__(self) -> None:
        if (self.model_name_or_path is None) == (self.model_config is None):
            which = "both are" if self.model_name_or_path is not None else "neither is"
            raise ValueError(
                f"Give exactly one of model_name_or_path (a pretrained model) and model_config (a mapping with "
                f"'model_type' to build a random model); {which} set."
            )
        if isinstance(self.model_config, str):  # from the command line
            try:
                self.model_config = json.loads(self.model_config)
            except json.JSONDecodeError as err:
                raise ValueError(f"model_config on the command line must be a JSON object; {err}.") from None
        if self.model_config is not None:
            if not isinstance(self.model_config, dict) or "model_type" not in self.model_config:
                raise ValueError(
                    f"model_config must be a mapping with a 'model_type' key (e.g. {{model_type: llama, "
                    f"hidden_size: 64, ...}}), got {self.model_config!r}."
                )
            if self.tokenizer_name_or_path is None:
                raise ValueError(f"model_config needs tokenizer_name_or_path (a Hub id, a folder or '{BYTE_LEVEL}').")
        if self.dtype is not None and self.torch_dtype is not None and self.dtype != self.torch_dtype:
            raise ValueError(
                f"dtype={self.dtype!r} and torch_dtype={self.torch_dtype!r} are two names of one setting "
                "(torch_dtype is its name before transformers 5); give only one of them."
            )
        self.dtype = self.torch_dtype = self.dtype or self.torch_dtype or "auto"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype (torch_dtype) must be one of {list(DTYPES)}, got {self.dtype!r}.")
        if self.context_extension not in METHODS:
            raise ValueError(f"context_extension must be one of {list(METHODS)}, got {self.context_extension!r}.")
        if self.lora_r < 0:
            raise ValueError(f"lora_r must be >= 0 (0 = no LoRA), got {self.lora_r}.")
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]


@dataclass
class DataArguments:
    """Where the training (and evaluation) text comes from and how it becomes sequences."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset id (e.g. emozilla/pg19). Exactly one of this and data_files."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration (subset) of dataset_name."})
    dataset_split: str = field(
        default="train",
        metadata={"help": "Split to train on (datasets slicing works, e.g. 'train[:1000]')."},
    )
    data_files: list[str] | None = field(
        default=None,
        metadata={
            "help": "Local files, all of one format: .jsonl/.json, .txt (one example per line), .parquet or "
            ".csv. Relative paths are relative to the current directory."
        },
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the documents' text."})
    max_seq_length: int | None = field(
        default=None,
        metadata={"help": "Tokens per training sequence (packing: the most tokens per document piece)."},
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "Keep only the first N training sequences (after tokenization)."},
    )
    eval_data_files: list[str] | None = field(
        default=None,
        metadata={
            "help": "Evaluation data: local files, in the formats of data_files (run_clm's validation_file). "
            "At most one of eval_data_files / eval_split (alone) / validation_split_percentage."
        },
    )
    eval_split: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation data: this split of eval_data_files (default 'train', i.e. all of them) or, "
            "without eval_data_files, of the training source (dataset_name or data_files), e.g. "
            "'validation' or 'train[-5%%:]'."
        },
    )
    validation_split_percentage: float | None = field(
        default=None,
        metadata={
            "help": "Evaluation data: the first P%% of the documents of the training split (0 < P < 100); "
            "training uses the rest (run_clm's option)."
        },
    )
    max_eval_samples: int | None = field(
        default=None,
        metadata={"help": "Keep only the first N evaluation sequences (after tokenization)."},
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Pack per document with DataCollatorWithFlattening (documents never share attention or "
            "short-context windows; position ids restart) instead of run_clm-style concatenation."
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={"help": "Processes for tokenization (datasets.map num_proc)."},
    )
    preprocessing_batch_size: int = field(
        default=100,
        metadata={
            "help": "Documents per datasets.map batch. Each batch's tokens are held as Python lists (books: "
            "~100k tokens each), and run_clm-style grouping drops each batch's last partial block."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.data_files, str):
            self.data_files = [self.data_files]
        if (self.dataset_name is None) == (not self.data_files):
            which = "both are" if self.dataset_name is not None else "neither is"
            raise ValueError(
                f"Give the training data with exactly one of dataset_name (a Hub dataset) and data_files (local "
                f"JSONL/JSON/text/parquet/CSV files); {which} set."
            )
        if self.max_seq_length is None or self.max_seq_length < 2:
            raise ValueError(
                f"max_seq_length must be an integer >= 2 (tokens per training sequence), got {self.max_seq_length!r}."
            )
        if self.preprocessing_batch_size < 1:
            raise ValueError(f"preprocessing_batch_size must be >= 1, got {self.preprocessing_batch_size}.")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"max_train_samples must be >= 1 or unset, got {self.max_train_samples}.")
        if isinstance(self.eval_data_files, str):
            self.eval_data_files = [self.eval_data_files]
        if self.validation_split_percentage is not None:
            if self.eval_data_files or self.eval_split is not None:
                raise ValueError(
                    "validation_split_percentage takes the evaluation documents from the training split; "
                    "it cannot be combined with eval_data_files or eval_split. Give one of them."
                )
            if not 0 < self.validation_split_percentage < 100:
                raise ValueError(
                    f"validation_split_percentage must be between 0 and 100 (exclusive), got "
                    f"{self.validation_split_percentage!r}."
                )
        if self.max_eval_samples is not None and self.max_eval_samples < 1:
            raise ValueError(f"max_eval_samples must be >= 1 or unset, got {self.max_eval_samples}.")

    @property
    def has_eval_data(self) -> bool:
        return bool(self.eval_data_files) or self.eval_split is not None or self.validation_split_percentage is not None

    def eval_source(self) -> DataArguments:
        """The same settings pointing at the evaluation data (not for validation_split_percentage)."""
        if self.eval_data_files:
            return replace(
                self,
                dataset_name=None,
                dataset_config_name=None,
                data_files=self.eval_data_files,
                dataset_split=self.eval_split or "train",
                eval_data_files=None,
                eval_split=None,
            )
        return replace(self, dataset_split=self.eval_split, eval_split=None)


# ------------------------------------------------------------------ arguments


def load_recipe(path: str) -> dict[str, Any]:
    """The YAML mapping of a recipe file (``yaml.safe_load``: plain data only)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Config file {path!r} not found (--config takes a YAML recipe, e.g. configs/tiny_cpu.yaml)."
        )
    with open(path, encoding="utf-8") as handle:
        recipe = yaml.safe_load(handle)
    if recipe is None:
        return {}
    if not isinstance(recipe, dict):
        raise ValueError(
            f"Config file {path!r} must hold a YAML mapping of field: value, got a {type(recipe).__name__}."
        )
    return recipe


def resolve_recipe_paths(paths: str | list[str], recipe_path: str) -> list[str]:
    """``paths`` (one or a list) made absolute against the folder of ``recipe_path``; absolute paths and
    URLs (``scheme://``) are returned unchanged."""
    folder = os.path.dirname(os.path.abspath(recipe_path))
    paths = [paths] if isinstance(paths, str) else list(paths)
    return [p if os.path.isabs(p) or "://" in p else os.path.normpath(os.path.join(folder, p)) for p in paths]


def _given_on_command_line(argv: list[str]) -> set[str]:
    """Field names that ``argv`` sets (``--name value``, ``--name=value``, a bare ``--name``; or ``--na-me``)."""
    return {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}


def merge_aliases(recipe: dict[str, Any], argv: list[str], recipe_path: str) -> dict[str, Any]:
    """The recipe with each ``ALIASES`` group under one name, and none where the command line sets the group.

    A recipe giving both names of a group different values is an error; a name given on the command
    line overrides the recipe's value under either name (otherwise the dataclass would see both).
    """
    recipe = dict(recipe)
    on_command_line = _given_on_command_line(argv)
    for names in ALIASES:
        given = {name: recipe[name] for name in names if name in recipe}
        if len({repr(value) for value in given.values()}) > 1:
            raise ValueError(
                f"{recipe_path!r} sets {' and '.join(f'{k}: {v!r}' for k, v in given.items())}, two "
                "names of one field; keep one of them."
            )
        if on_command_line & set(names):
            for name in names:
                recipe.pop(name, None)
    return recipe


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one (not ``None``, not a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or (action.default is False and action.nargs == 0):
            return action.help
        return super()._get_help_string(action)


def build_parser(full: bool = True) -> HfArgumentParser:
    """The parser of the three argument dataclasses, ``--config`` first.

    ``full=False`` is what ``--help`` prints: ``ModelArguments``, ``DataArguments`` and the
    ``longce_*`` fields of ``LongCEConfig``, with a pointer to ``--help-all`` for every field.
    """
    parser = HfArgumentParser(
        [],
        prog="train_longce.py",
        usage="%(prog)s --config RECIPE.yaml [--FIELD VALUE ...]",
        formatter_class=_HelpFormatter,
        description="Fine-tune a causal LM with LongCE from a YAML recipe; every field below can be set in the "
        "recipe or overridden on the command line.",
        epilog=None
        if full
        else (
            "Every TrainingArguments field (output_dir, max_steps, learning_rate, per_device_train_batch_size, "
            "gradient_accumulation_steps, eval_strategy, eval_steps, bf16, activation_checkpointing, save_steps, "
            "report_to, ...) can be set too, in the recipe or as --FIELD VALUE: `--help-all` lists them all."
        ),
    )
    parser.add_argument(
        "--config",
        help="YAML recipe (e.g. configs/tiny_cpu.yaml) whose fields become the defaults "
        "of the options below; the command line overrides them.",
    )
    parser.add_argument(
        "--help-all",
        "--help_all",
        action="store_true",
        help="Show every option, TrainingArguments' included, and exit.",
    )
    groups = [(ModelArguments, "Model (ModelArguments)"), (DataArguments, "Data (DataArguments)")]
    if full:
        groups.append((LongCEConfig, "Training (LongCEConfig: TrainingArguments plus the longce_* fields)"))
    else:
        groups.append((_longce_fields(), "LongCE (the longce_* fields of LongCEConfig)"))
    for cls, title in groups:
        group = parser.add_argument_group(title)
        hints = get_type_hints(cls)
        for spec in fields(cls):
            if spec.init:
                spec.type = hints[spec.name]  # what HfArgumentParser._add_dataclass_arguments does, in a titled group
                parser._parse_dataclass_field(group, spec)
        parser.dataclass_types.append(cls)
    return parser


def _longce_fields() -> type:
    """A dataclass of the ``longce_*`` fields of ``LongCEConfig`` alone (for the short ``--help``)."""
    hints = get_type_hints(LongCEConfig)
    spec = [
        (f.name, hints[f.name], field(default=f.default, metadata=f.metadata))
        for f in fields(LongCEConfig)
        if f.name.startswith(LONGCE_PREFIX)
    ]
    return make_dataclass("LongCEFields", spec)


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, LongCEConfig]:
    """Parse ``--config recipe.yaml`` plus command-line overrides into the three argument dataclasses.

    ``-h``/``--help`` and ``--help-all`` print the help (with the recipe's values as defaults) and exit.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("-h", "--help", action="store_true")
    pre.add_argument("--help-all", "--help_all", action="store_true")
    known, _ = pre.parse_known_args(argv)

    recipe: dict[str, Any] = {}
    if known.config is not None:
        recipe = load_recipe(known.config)
        valid = {f.name for cls in (ModelArguments, DataArguments, LongCEConfig) for f in fields(cls) if f.init}
        unknown = sorted(set(recipe) - valid)
        if unknown:
            raise ValueError(
                f"Unknown field(s) {unknown} in {known.config!r}; see `python scripts/train_longce.py "
                "--help-all` for the valid ones (ModelArguments, DataArguments, LongCEConfig)."
            )
        # A recipe's data files are relative to the recipe, so it runs from any directory; paths given on the
        # command line stay relative to the current directory, as usual.
        for key in ("data_files", "eval_data_files"):
            if recipe.get(key):
                recipe[key] = resolve_recipe_paths(recipe[key], known.config)
        recipe = merge_aliases(recipe, argv, known.config)

    parser = build_parser(full=not known.help or known.help_all)
    # Defaults, not values: the command line still overrides (string defaults are converted by type).
    parser.set_defaults(**{key: value for key, value in recipe.items() if key in _destinations(parser)})
    if known.help or known.help_all:
        parser.print_help()
        raise SystemExit(0)
    model_args, data_args, training_args, _ = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return model_args, data_args, training_args


def _destinations(parser: argparse.ArgumentParser) -> set[str]:
    return {action.dest for action in parser._actions}


# ------------------------------------------------------------------ tokenizer and model


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of the ByteLevel pre-tokenizer)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (id = byte value), ``<s>``=256, ``</s>``=257, ``<pad>``=258; prepends ``<s>``.

    A BPE model without merges over the ByteLevel alphabet, so it needs no training and decodes any
    text back exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def load_tokenizer(model_args: ModelArguments):
    """The tokenizer named by ``tokenizer_name_or_path`` (default: the model's)."""
    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    tokenizer = (
        byte_level_tokenizer()
        if name == BYTE_LEVEL
        else AutoTokenizer.from_pretrained(name, cache_dir=model_args.cache_dir)
    )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"Tokenizer {name!r} has no EOS token; documents are separated by EOS. Use a tokenizer "
            "with one (or add one and resize the model's embeddings)."
        )
    return tokenizer


def load_model(model_args: ModelArguments, training_args: LongCEConfig, tokenizer) -> torch.nn.Module:
    """Build (``model_config``) or load the model, after the context extension edited its config; then LoRA."""
    if model_args.model_config is not None:
        kwargs = dict(model_args.model_config)
        kwargs.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs.setdefault(name, getattr(tokenizer, name))
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    else:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir)
    attn = apply_context_extension(
        config,
        model_args.context_extension,
        factor=model_args.rope_factor,
        rope_theta=model_args.rope_theta,
        original_max_position_embeddings=model_args.original_max_position_embeddings,
        eabf_base_length=model_args.eabf_base_length,
    )
    if attn is not None and model_args.attn_implementation not in (None, attn):
        raise ValueError(
            f"context_extension={model_args.context_extension!r} needs its own attention ({attn!r}); "
            f"unset attn_implementation (got {model_args.attn_implementation!r})."
        )
    attn = attn or model_args.attn_implementation
    dtype = DTYPES[model_args.dtype]
    set_seed(training_args.seed)  # random init (model_config) and LoRA init follow the run's seed
    if model_args.model_config is not None:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if dtype == "auto" else dtype, attn_implementation=attn
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            dtype=dtype,
            attn_implementation=attn,
            cache_dir=model_args.cache_dir,
        )
    embedding = model.get_input_embeddings().weight
    rows = getattr(embedding, "ds_shape", embedding.shape)[0]  # DeepSpeed ZeRO-3 keeps the full shape aside
    if len(tokenizer) > rows:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} rows; "
            "use the model's own tokenizer or a larger vocab_size."
        )
    if model_args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        if training_args.activation_checkpointing:  # LongCEConfig mirrors gradient_checkpointing into it
            # Frozen embeddings give checkpointed blocks inputs without grad; LoRA weights inside them need it.
            model.enable_input_require_grads()
        lora = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=list(model_args.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model


# ------------------------------------------------------------------ data


def _data_source(data_args: DataArguments) -> str:
    return data_args.dataset_name if data_args.dataset_name is not None else ", ".join(data_args.data_files)


def load_text_dataset(
    data_args: DataArguments, cache_dir: str | None = None, files_field: str = "data_files"
) -> datasets.Dataset:
    """The raw ``dataset_split`` with a string ``text_column`` (Hub dataset or local files).

    ``files_field``: the option that named ``data_files``, for the error messages.
    """
    if data_args.dataset_name is not None:
        raw = datasets.load_dataset(
            data_args.dataset_name, data_args.dataset_config_name, split=data_args.dataset_split, cache_dir=cache_dir
        )
    else:
        suffixes = set()
        for path in data_args.data_files:
            suffix = os.path.splitext(path)[1].lower()
            if suffix not in DATA_FILE_BUILDERS:
                raise ValueError(
                    f"{files_field}: {path!r} has an unsupported extension; use one of {sorted(DATA_FILE_BUILDERS)}."
                )
            if not any(c in path for c in "*?[") and not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{files_field}: {path!r} not found (on the command line relative paths are "
                    f"relative to the current directory, {os.getcwd()}; in a recipe, to the "
                    "recipe's folder)."
                )
            suffixes.add(DATA_FILE_BUILDERS[suffix])
        if len(suffixes) > 1:
            raise ValueError(f"{files_field} mixes formats {sorted(suffixes)}; give files of one format.")
        raw = datasets.load_dataset(
            suffixes.pop(), data_files=list(data_args.data_files), split=data_args.dataset_split, cache_dir=cache_dir
        )
    if data_args.text_column not in raw.column_names:
        raise ValueError(
            f"Text column {data_args.text_column!r} not found in {_data_source(data_args)}; its columns "
            f"are {raw.column_names}. Set text_column to one of them."
        )
    feature = raw.features[data_args.text_column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(
            f"Text column {data_args.text_column!r} of {_data_source(data_args)} holds {feature}, not "
            "strings; point text_column at a column of text."
        )
    return raw


def tokenize_documents(raw: datasets.Dataset, tokenizer, data_args: DataArguments) -> datasets.Dataset:
    """``input_ids`` of every document, special tokens as the tokenizer adds them, EOS appended."""
    column, eos = data_args.text_column, tokenizer.eos_token_id

    def tokenize(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        for index, text in zip(indices, batch[column]):
            if not isinstance(text, str):  # nulls in a string column
                raise ValueError(
                    f"Row {index} of {_data_source(data_args)} has {text!r} in text column {column!r}; "
                    "every document must be a string."
                )
        ids = tokenizer(batch[column], add_special_tokens=True, verbose=False)["input_ids"]
        return {"input_ids": [doc + [eos] for doc in ids]}

    return raw.map(
        tokenize,
        batched=True,
        batch_size=data_args.preprocessing_batch_size,
        with_indices=True,
        remove_columns=raw.column_names,
        num_proc=data_args.preprocessing_num_workers,
        desc="tokenizing",
    )


def build_sequences(
    raw: datasets.Dataset, tokenizer, data_args: DataArguments, max_samples: int | None = None, what: str = "training"
) -> datasets.Dataset:
    """Sequences of ``raw``: run_clm-style blocks with ``labels``, or per-document pieces (``packing``).

    ``max_samples`` keeps the first N sequences; ``what`` ("training", "evaluation") names them in errors.
    """
    documents = tokenize_documents(raw, tokenizer, data_args)
    length = data_args.max_seq_length

    def group(batch: dict[str, list]) -> dict[str, list]:
        # run_clm: the tail of each map batch that does not fill a block is dropped.
        tokens = list(chain.from_iterable(batch["input_ids"]))
        blocks = [tokens[i : i + length] for i in range(0, len(tokens) - length + 1, length)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    def split(batch: dict[str, list]) -> dict[str, list]:
        # A piece with one token has nothing to predict.
        pieces = [doc[i : i + length] for doc in batch["input_ids"] for i in range(0, len(doc), length)]
        return {"input_ids": [piece for piece in pieces if len(piece) >= 2]}

    sequences = documents.map(
        split if data_args.packing else group,
        batched=True,
        batch_size=data_args.preprocessing_batch_size,
        num_proc=data_args.preprocessing_num_workers,
        desc="splitting documents" if data_args.packing else f"grouping into blocks of {length}",
    )
    if len(sequences) == 0:
        total = sum(len(ids) for ids in documents["input_ids"])
        raise ValueError(
            f"{_data_source(data_args)} gives no {what} sequence: {total} tokens in all, fewer than "
            f"max_seq_length={length}. Use more data, a smaller max_seq_length or packing: true."
        )
    if max_samples is not None:
        sequences = sequences.select(range(min(max_samples, len(sequences))))
    return sequences


def build_train_dataset(raw: datasets.Dataset, tokenizer, data_args: DataArguments) -> datasets.Dataset:
    """Training sequences of ``raw`` (``build_sequences`` with ``max_train_samples``)."""
    return build_sequences(raw, tokenizer, data_args, data_args.max_train_samples, "training")


def load_datasets(
    data_args: DataArguments, tokenizer, cache_dir: str | None = None
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Training and evaluation sequences (``None`` without evaluation data), built the same way.

    Evaluation text comes from ``eval_data_files`` (split ``eval_split``, default all of them), from
    split ``eval_split`` of the training source, or from the first ``validation_split_percentage``
    percent of the training split's documents, which training then leaves out (as run_clm does).
    """
    raw = load_text_dataset(data_args, cache_dir)
    eval_raw = None
    if data_args.validation_split_percentage is not None:
        count = round(len(raw) * data_args.validation_split_percentage / 100)
        if not 0 < count < len(raw):
            raise ValueError(
                f"validation_split_percentage={data_args.validation_split_percentage} of the "
                f"{len(raw)} documents of {_data_source(data_args)} leaves "
                f"{'no evaluation' if count == 0 else 'no training'} document; use another percentage "
                "or eval_data_files."
            )
        eval_raw, raw = raw.select(range(count)), raw.select(range(count, len(raw)))
    elif data_args.has_eval_data:
        source = data_args.eval_source()
        eval_raw = load_text_dataset(
            source, cache_dir, "eval_data_files" if data_args.eval_data_files else "data_files"
        )
    train = build_train_dataset(raw, tokenizer, data_args)
    if eval_raw is None:
        return train, None
    source = data_args.eval_source() if data_args.validation_split_percentage is None else data_args
    return train, build_sequences(eval_raw, tokenizer, source, data_args.max_eval_samples, "evaluation")


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> LongCETrainer:
    """Parse the arguments, train (resuming if asked), evaluate, save the model; returns the trainer.

    With evaluation data, ``eval_strategy`` steps/epoch evaluates during training; with
    ``eval_strategy`` no, once after training.
    """
    model_args, data_args, training_args = parse_args(argv)
    if training_args.eval_strategy != "no" and not data_args.has_eval_data:
        raise ValueError(
            f"eval_strategy={training_args.eval_strategy.value!r} needs evaluation data: set "
            "eval_data_files (local files), eval_split (a split of the training source, e.g. "
            "'validation') or validation_split_percentage (hold out a share of the training documents)."
        )
    tokenizer = load_tokenizer(model_args)
    # Rank 0 tokenizes first and fills the datasets cache; the other ranks then read it.
    with training_args.main_process_first(desc="dataset preparation"):
        train_dataset, eval_dataset = load_datasets(data_args, tokenizer, model_args.cache_dir)
    model = load_model(model_args, training_args, tokenizer)
    collator = DataCollatorWithFlattening() if data_args.packing else default_data_collator

    trainer = LongCETrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collator,
        processing_class=tokenizer,
    )
    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("last", "true"):
        resume = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
        if resume is None:
            raise ValueError(
                f"resume_from_checkpoint='last' but {training_args.output_dir!r} holds no checkpoint-* folder."
            )
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    if eval_dataset is not None and training_args.eval_strategy == "no":
        trainer.evaluate()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: the logged losses and LongCE statistics of every step
    if trainer.is_world_process_zero():
        print_summary(
            trainer,
            model_args,
            data_args,
            training_args,
            len(train_dataset),
            result.training_loss,
            time.perf_counter() - start,
            resume,
        )
    return trainer


def print_summary(trainer, model_args, data_args, training_args, sequences, training_loss, seconds, resume) -> None:
    """A few lines on what was trained and how the loss went."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    global_batch = (
        training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * training_args.world_size
    )
    model = model_args.model_name_or_path or f"random {model_args.model_config['model_type']}"
    print(
        f"LongCE training done: {model}, context extension {model_args.context_extension}, "
        f"{trainable:,} of {total:,} parameters trained"
    )
    print(
        f"  data: {_data_source(data_args)}, {sequences} sequences of <= {data_args.max_seq_length} tokens"
        f"{' (packed per document)' if data_args.packing else ''}, global batch {global_batch}"
    )
    print(
        f"  steps: {trainer.state.global_step}{f' (resumed from {resume})' if resume else ''} in {seconds:.1f} s; "
        f"mean training loss {training_loss:.4f}"
    )
    if losses:
        print(
            f"  logged loss: first {losses[0]:.4f}, last {losses[-1]:.4f}"
            f"{'' if math.isfinite(losses[-1]) else ' (not finite!)'}"
        )
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    if evaluations:
        last = evaluations[-1]
        print(
            f"  evaluation: {len(evaluations)} run(s); at step {last['step']} eval_loss {last['eval_loss']:.4f}"
            + (f", eval_ce_loss {last['eval_ce_loss']:.4f}" if "eval_ce_loss" in last else "")
        )
    print(f"  saved to {training_args.output_dir}")


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a gloo group left open can abort the process at exit
