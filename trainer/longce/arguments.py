"""The arguments of ``longce-train``: ``ModelArguments``, ``DataArguments`` and the parser of YAML recipes.

A recipe (``--config recipe.yaml``) sets fields of ``ModelArguments``, ``DataArguments`` and
``RecipeConfig`` (``LongCEConfig``, i.e. ``TrainingArguments`` plus ``longce_*``, plus the command's own
``overwrite_output_dir`` and ``torch_threads``); its values become the parser's defaults (as
TRL's ``TrlParser`` does), so the command line always wins. Unknown recipe keys are an error. A recipe's
``data_files`` / ``eval_data_files`` / ``key_tokens`` are relative to the recipe's folder (``resolve_recipe_paths``), so it
runs from any directory; paths on the command line stay relative to the current directory. Renamed
fields take either name (``ALIASES``). ``--help`` lists the model, data and LongCE fields, ``--help-all``
every ``TrainingArguments`` field too. A mistyped option is an error that names the closest field.

Nothing here loads data or models: ``datasets`` and the model classes load after parsing
(``longce.data``, ``longce.cli``), so ``--help`` answers at once after transformers is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, dataclass, field, fields, make_dataclass, replace
from typing import Any, get_type_hints

from transformers import HfArgumentParser

from .config import LongCEConfig, LongCESettings
from .context_extension import METHODS

# The reading of a recipe and the messages for names no field has need no torch: they live in
# `recipes`, which the command runs before this module is imported (`recipes.check_before_loading`).
# PROG: the command's name in messages when it is called from Python; a command shows the name it
# was started by (`longppl train`, `longce-train`), passed on as `prog`.
from .recipes import (  # noqa: F401  (load_recipe, resolve_recipe_paths: importable from here as before)
    PROG,
    load_recipe,
    resolve_recipe_paths,
    unknown_arguments_message,
    unknown_fields_message,
)
from .weight_sources import WEIGHTS_COLUMN, weight_source_for

BYTE_LEVEL = "byte-level"
# Names of the model weights' dtypes (``longce.cli.load_model`` maps them to torch dtypes).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Two names of one field (the first is the current transformers name): either works, in the recipe or
# on the command line; the dataclasses refuse both names with different values.
ALIASES = (
    ("dtype", "torch_dtype"),
    ("activation_checkpointing", "gradient_checkpointing"),
    ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"),
    # the names of transformers' run_clm and TRL's SFTConfig for fields of DataArguments
    ("data_files", "train_file"),
    ("eval_data_files", "validation_file"),
    ("max_seq_length", "block_size"),
    ("text_column", "dataset_text_field"),
)
# A field given on the command line replaces these recipe fields too (command line > recipe >
# defaults, as TRL's --config): the model or the data comes from one source, and the recipe's
# tokenizer belongs to the recipe's model (the new model's own is the default).
REPLACES = {
    "model_name_or_path": ("model_config", "tokenizer_name_or_path"),
    "model_config": ("model_name_or_path",),
    "dataset_name": ("data_files",),
    "data_files": ("dataset_name", "dataset_config_name"),
}
# DataArguments fields that choose rows of the key_tokens cache (an evaluator, its settings).
KEY_TOKENS_CHOICES = ("key_tokens_evaluator", "key_tokens_trunc_len", "key_tokens_sliding_window")
# Shown by --help besides ModelArguments and DataArguments (--help-all: every LongCEConfig field).
LONGCE_PREFIX = "longce_"


@dataclass
class ModelArguments:
    """Which model and tokenizer to train, its context extension and its LoRA adapter."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub id or local folder of a pretrained causal LM. Exactly one of this and model_config "
            "(given on the command line, it replaces the recipe's model_config and tokenizer)."
        },
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
            "(positions divided by rope_factor), ntk (NTK-aware: the RoPE base raised by rope_factor), abf "
            "(rope_theta), yarn (rope_factor, "
            "original_max_position_embeddings) or eabf (rope_theta plus attention scaling with "
            "eabf_base_length).",
            "choices": list(METHODS),
        },
    )
    rope_factor: float | None = field(
        default=None,
        metadata={"help": "PI / NTK / YaRN scaling factor: new context length / pre-training context length."},
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
    key_tokens: str | None = field(
        default=None,
        metadata={
            "help": "With longce_weights 'cache': the key-token cache (the --output folder of longppl-score) "
            "holding an evaluator's scores of every training and evaluation text; each token is weighted by "
            "the evaluator's min(exp(LSD), longce_gamma) (longce.add_key_token_weights). In a recipe, "
            "relative to the recipe's folder."
        },
    )
    key_tokens_evaluator: str | None = field(
        default=None,
        metadata={
            "help": "Which rows of a key_tokens cache holding several evaluators: an evaluator name or the "
            "start of its fingerprint."
        },
    )
    key_tokens_trunc_len: int | None = field(
        default=None,
        metadata={"help": "Which rows of a key_tokens cache holding several settings: the evaluator's K."},
    )
    key_tokens_sliding_window: int | None = field(
        default=None,
        metadata={"help": "Which rows of a key_tokens cache holding several settings: the evaluator's d."},
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

    train_file: str | None = field(default=None, metadata={"help": "Same as data_files (run_clm's name)."})
    validation_file: str | None = field(default=None, metadata={"help": "Same as eval_data_files (run_clm's name)."})
    block_size: int | None = field(default=None, metadata={"help": "Same as max_seq_length (run_clm's name)."})
    dataset_text_field: str | None = field(default=None, metadata={"help": "Same as text_column (TRL's name)."})

    def __post_init__(self) -> None:
        for name, alias in (("data_files", "train_file"), ("eval_data_files", "validation_file")):
            if isinstance(getattr(self, alias), str):
                setattr(self, alias, [getattr(self, alias)])
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])
        _merge_alias(self, "data_files", "train_file")
        _merge_alias(self, "eval_data_files", "validation_file")
        _merge_alias(self, "max_seq_length", "block_size")
        _merge_alias(self, "text_column", "dataset_text_field", default="text")
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
        choices = {name: getattr(self, name) for name in KEY_TOKENS_CHOICES if getattr(self, name) is not None}
        if choices and self.key_tokens is None:
            raise ValueError(
                f"{', '.join(choices)} choose(s) rows of the key_tokens cache, but key_tokens is not set; set "
                "key_tokens (and longce_weights: cache) or drop them."
            )
        for name in ("key_tokens_trunc_len", "key_tokens_sliding_window"):
            if choices.get(name) is not None and choices[name] < 1:
                raise ValueError(f"{name} must be >= 1 or unset, got {choices[name]}.")

    @property
    def source_name(self) -> str:
        """The training source for messages: ``dataset_name`` or the ``data_files``, comma-separated."""
        return self.dataset_name if self.dataset_name is not None else ", ".join(self.data_files)

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


@dataclass
class RecipeConfig(LongCEConfig):
    """``LongCEConfig`` plus the fields of the ``longce-train`` command itself (not of the trainer):
    what to do with an ``output_dir`` that holds files, and torch's CPU threads.

    ``longce.cli.train`` passes it to ``LongCETrainer`` as its ``args`` (it is a ``LongCEConfig``).
    """

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "An output_dir holding files: by default (as run_clm) a folder with checkpoint-* folders "
            "resumes from its last checkpoint (a finished run is left as it is: raise max_steps to continue it) and "
            "any other non-empty folder is refused. With this flag, train "
            "afresh into it (same-named files replaced); checkpoint-* folders are still refused (never deleted)."
        },
    )
    torch_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch's CPU threads (unset: one per core); OMP_NUM_THREADS wins. Tiny models train fastest "
            "on 1 (configs/tiny_cpu.yaml): extra threads only wait."
        },
    )

    def __post_init__(self) -> None:
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(
                f"torch_threads must be >= 1 (CPU threads of torch's operations) or unset, got {self.torch_threads}."
            )
        super().__post_init__()


def check_weight_source(data_args: DataArguments, training_args: LongCEConfig) -> None:
    """``key_tokens`` is given exactly when the weight source reads the ``longce_weights`` column that the
    recipe builds from it (``longce_weights: cache``); a ``ValueError`` says what to set."""
    source = weight_source_for(LongCESettings.from_args(training_args))
    reads_cache = WEIGHTS_COLUMN in source.batch_columns
    if reads_cache and data_args.key_tokens is None:
        raise ValueError(
            "longce_weights='cache' weights each token from an evaluator's key-token cache, but key_tokens is not "
            "set. Score the training texts once (longppl-score --corpus <the texts> --evaluator <model> --output "
            "<folder>) and pass --key_tokens <folder>, or use longce_weights 'self' (the trained model scores "
            "each batch)."
        )
    if not reads_cache and data_args.key_tokens is not None:
        raise ValueError(
            f"key_tokens={data_args.key_tokens!r} is read only with longce_weights 'cache', but longce_weights is "
            f"{training_args.longce_weights!r} (the trained model scores its own weights). Add --longce_weights "
            "cache to train with the cache's weights, or drop key_tokens."
        )


def _merge_alias(owner, name: str, alias: str, default=None) -> None:
    """One value for a field and its other name (``ALIASES``): the one given, under both names; two
    different values are a ``ValueError``. ``default``: the field's default, which the alias overrides.
    The value ends under ``name``; ``alias`` is reset to ``None``."""
    value, other = getattr(owner, name), getattr(owner, alias)
    if other is not None and value not in (default, other):
        raise ValueError(f"{name}={value!r} and {alias}={other!r} are two names of one setting; give only one of them.")
    setattr(owner, name, other if other is not None else value)
    setattr(owner, alias, None)  # one name holds it: dataclasses.replace(owner, name=...) must not see two


# ------------------------------------------------------------------ recipes and the parser


def _given_on_command_line(argv: list[str]) -> set[str]:
    """Field names that ``argv`` sets (``--name value``, ``--name=value``, a bare ``--name``; or ``--na-me``)."""
    return {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}


def merge_aliases(recipe: dict[str, Any], argv: list[str], recipe_path: str) -> dict[str, Any]:
    """The recipe with each ``ALIASES`` group under one name, and none where the command line sets the group.

    A recipe giving both names of a group different values is an error; a name given on the command
    line overrides the recipe's value under either name (otherwise the dataclass would see both). A
    model or data source given on the command line replaces the recipe's (``REPLACES``): the recipe's
    ``model_config`` (and its tokenizer) gives way to ``--model_name_or_path`` and the reverse, its
    ``data_files`` to ``--dataset_name``.
    """
    recipe = dict(recipe)
    on_command_line = _given_on_command_line(argv)
    canonical = {alias: names[0] for names in ALIASES for alias in names}
    for given in {canonical.get(name, name) for name in on_command_line}:
        for replaced in REPLACES.get(given, ()):
            if canonical.get(replaced, replaced) not in {canonical.get(n, n) for n in on_command_line}:
                for names in ALIASES:
                    if replaced in names:
                        for name in names:
                            recipe.pop(name, None)
                recipe.pop(replaced, None)
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


class RecipeParser(HfArgumentParser):
    """An ``HfArgumentParser`` of argument dataclasses with ``--config`` (a YAML recipe) and ``--help-all``.

    As TRL's ``TrlParser``: a recipe's values become the defaults of the dataclass fields
    (:meth:`set_recipe_defaults`, argparse's ``set_defaults``), so the command line overrides them.
    Built on ``HfArgumentParser``'s public API only (the constructor, ``parse_args_into_dataclasses``;
    a dataclass's ``_argument_group_name`` titles its group, as ``HfArgumentParser`` documents), so it
    works across transformers releases. Every field takes ``--a_b`` and ``--a-b`` (``HfArgumentParser``
    declares both). ``--config`` and ``--help-all`` come first in ``--help``, with ``-h``.
    """

    def __init__(self, dataclass_types: list[type], **kwargs) -> None:
        super().__init__(dataclass_types, **kwargs)
        self.add_argument(
            "--config",
            help="YAML recipe (e.g. configs/tiny_cpu.yaml) whose fields become the defaults "
            "of the options below; the command line overrides them.",
        )
        self.add_argument(
            "--help-all",
            "--help_all",
            action="store_true",
            help="Show every option, TrainingArguments' included, and exit.",
        )

    def error(self, message: str):
        """A usage error (a value of the wrong type, an option without its value...) as a ``ValueError``,
        which the command prints as one ``<prog>: error: ...`` line (``run_command``) instead of
        argparse's usage block of every field first."""
        raise ValueError(f"{message}; `{self.prog} --help` lists the fields and their types.")

    @property
    def field_names(self) -> set[str]:
        """The names of the fields this parser sets (``init`` fields of its dataclasses)."""
        return {spec.name for cls in self.dataclass_types for spec in fields(cls) if spec.init}

    def field_options(self) -> list[str]:
        """Every option of a field, as ``HfArgumentParser`` declares them: ``--a_b`` and ``--a-b``, and
        ``--no_a_b`` / ``--no-a-b`` for a boolean field that defaults to ``True``."""
        options = []
        for cls in self.dataclass_types:
            for spec in fields(cls):
                if spec.init:
                    names = [spec.name] + (["no_" + spec.name] if spec.default is True else [])
                    options += [f"--{spelling}" for name in names for spelling in {name, name.replace("_", "-")}]
        return sorted(options)

    def set_recipe_defaults(self, recipe: dict[str, Any]) -> None:
        """The recipe's values as the defaults of this parser's fields (other keys are left out: the short
        ``--help`` shows only some fields). Defaults, not values: the command line still overrides, and
        argparse converts a string default by the field's type."""
        names = self.field_names
        self.set_defaults(**{key: value for key, value in recipe.items() if key in names})

    def parse_recipe_and_args(self, argv: list[str], recipe: dict[str, Any]) -> tuple:
        """The dataclass instances of ``recipe`` (checked, see :func:`read_recipe`) overridden by ``argv``.

        An argument no field takes is a ``ValueError`` naming the closest field's option.
        """
        self.set_recipe_defaults(recipe)
        *parsed, remaining = self.parse_args_into_dataclasses(
            args=argv, look_for_args_file=False, return_remaining_strings=True
        )
        if remaining:
            raise ValueError(unknown_arguments_message(remaining, self.field_options(), self.prog))
        return tuple(parsed[: len(self.dataclass_types)])


#: The fields of each group of ``--help`` (``full``: every field; otherwise the recipe's own and LongCE's,
#: TrainingArguments' behind ``--help-all``), as (dataclass, which fields, title).
def _help_groups(full: bool) -> list[tuple[type, Any, str]]:
    groups = [
        (ModelArguments, None, "Model (ModelArguments)"),
        (DataArguments, None, "Data (DataArguments)"),
    ]
    if full:
        return groups + [
            (
                RecipeConfig,
                None,
                "Training (RecipeConfig: TrainingArguments, the longce_* fields of LongCEConfig, and "
                "overwrite_output_dir, torch_threads)",
            )
        ]
    own = {f.name for f in fields(RecipeConfig)} - {f.name for f in fields(LongCEConfig)}
    return groups + [
        (RecipeConfig, lambda name: name.startswith(LONGCE_PREFIX), "LongCE (the longce_* fields of LongCEConfig)"),
        (RecipeConfig, own.__contains__, "Command (the fields longce-train adds: RecipeConfig)"),
    ]


def build_parser(full: bool = True, recipe: dict[str, Any] | None = None, prog: str | None = None) -> RecipeParser:
    """The parser that prints ``--help``: one titled group per argument dataclass, ``--config`` first.

    ``full=False`` is the short help: ``ModelArguments``, ``DataArguments``, the ``longce_*`` fields of
    ``LongCEConfig`` and the command's own fields of ``RecipeConfig``, with a pointer to ``--help-all``
    for every field. Each option shows its default (``recipe``'s value where it sets one) unless that is
    ``None``. Parsing uses the argument dataclasses themselves (:func:`parse_args`). ``prog``: the name in
    the usage line (default: the program's, ``sys.argv[0]``).
    """
    recipe = recipe or {}
    parser = RecipeParser(
        [_help_fields(cls, keep, title, recipe) for cls, keep, title in _help_groups(full)],
        prog=prog,
        usage="%(prog)s --config RECIPE.yaml [--FIELD VALUE ...]",
        formatter_class=argparse.HelpFormatter,  # each help string carries its default (_help_fields)
        description="Fine-tune a causal LM with LongCE from a YAML recipe; every field below can be set in the "
        "recipe or overridden on the command line.",
        epilog=(
            ""
            if full
            else "Every TrainingArguments field (output_dir, max_steps, learning_rate, per_device_train_batch_size, "
            "gradient_accumulation_steps, eval_strategy, eval_steps, bf16, activation_checkpointing, save_steps, "
            "report_to, ...) can be set too, in the recipe or as --FIELD VALUE: `--help-all` lists them all. "
        )
        + "A bad input ends with one error line; LONGPPL_DEBUG=1 shows its traceback.",
    )
    parser.set_recipe_defaults(recipe)
    return parser


def _help_fields(cls: type, keep, title: str, recipe: dict[str, Any]) -> type:
    """A dataclass of the fields of ``cls`` that ``keep(name)`` accepts (all for ``None``), for ``--help``:
    titled ``title`` (``HfArgumentParser`` groups a dataclass's fields under its ``_argument_group_name``),
    each help ending with the default (``recipe``'s value, else the field's) unless that is ``None``."""
    hints = get_type_hints(cls)
    specs = []
    for spec in fields(cls):
        if not spec.init or (keep is not None and not keep(spec.name)):
            continue
        if spec.name in recipe:
            default = recipe[spec.name]
        else:
            default = spec.default_factory() if spec.default_factory is not MISSING else spec.default
        help_text = spec.metadata.get("help", "")
        if default is not None and default is not MISSING:
            help_text += f" (default: {default})".replace("%", "%%")  # argparse formats help with %
        metadata = {**spec.metadata, "help": help_text}
        specs.append(
            (
                spec.name,
                hints[spec.name],
                field(default=spec.default, default_factory=spec.default_factory, metadata=metadata),
            )
        )
    help_class = make_dataclass(f"{cls.__name__}Help", specs, kw_only=True)
    help_class._argument_group_name = title
    return help_class


def read_recipe(path: str, argv: list[str], prog: str = PROG) -> dict[str, Any]:
    """The recipe at ``path``, checked and ready to be the parser's defaults.

    Unknown keys are a ``ValueError`` (``prog``: the command's name in it); ``data_files`` / ``eval_data_files`` / ``key_tokens`` become
    paths relative to the recipe's folder; each ``ALIASES`` group is merged (``merge_aliases``).
    """
    recipe = load_recipe(path)
    valid = {f.name for cls in (ModelArguments, DataArguments, RecipeConfig) for f in fields(cls) if f.init}
    unknown = sorted(set(recipe) - valid)
    if unknown:
        raise ValueError(unknown_fields_message(unknown, path, prog))
    # A recipe's data files are relative to the recipe, so it runs from any directory; paths given on the
    # command line stay relative to the current directory, as usual.
    for key in ("data_files", "eval_data_files", "train_file", "validation_file"):
        if recipe.get(key):
            recipe[key] = resolve_recipe_paths(recipe[key], path)
    if isinstance(recipe.get("key_tokens"), str):
        recipe["key_tokens"] = resolve_recipe_paths(recipe["key_tokens"], path)[0]
    return merge_aliases(recipe, argv, path)


class _PreParser(argparse.ArgumentParser):
    """The first pass of :func:`parse_args` (``--config``, the help flags), with one-line errors too."""

    error = RecipeParser.error


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> tuple[ModelArguments, DataArguments, RecipeConfig]:
    """Parse ``--config recipe.yaml`` plus command-line overrides into the three argument dataclasses.

    ``-h``/``--help`` and ``--help-all`` print the help (with the recipe's values as defaults) and exit.
    An option that is no field (``--max_stesp 5``) is a ``ValueError`` naming the closest field.
    ``prog``: the command's name in messages. Settings that the chosen weight source never reads,
    given in the recipe or on the command line, get one warning line on stderr (:func:`unread_settings`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = _PreParser(prog=prog, add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("-h", "--help", action="store_true")
    pre.add_argument("--help-all", "--help_all", action="store_true")
    known, _ = pre.parse_known_args(argv)
    recipe = read_recipe(known.config, argv, prog) if known.config is not None else {}
    if known.help or known.help_all:
        build_parser(full=not known.help or known.help_all, recipe=recipe, prog=prog).print_help()
        raise SystemExit(0)
    parser = RecipeParser([ModelArguments, DataArguments, RecipeConfig], prog=prog)
    model_args, data_args, training_args = parser.parse_recipe_and_args(argv, recipe)
    note = unread_settings(training_args, set(recipe) | _given_on_command_line(argv))
    if note is not None and training_args.process_index == 0:
        print(f"{prog}: warning: {note}", file=sys.stderr, flush=True)
    return model_args, data_args, training_args


#: The ``longce_*`` fields that only the trained model's short-context pass reads (``longce_weights``
#: 'self'): with weights from a key-token cache they change nothing.
SHORT_PASS_FIELDS = (
    "longce_trunc_len",
    "longce_sliding_window",
    "longce_max_tokens_per_batch",
    "longce_compile_windows",
)


def unread_settings(training_args: LongCEConfig, given: set[str]) -> str | None:
    """The warning for the fields among ``given`` (names set in the recipe or on the command line) that
    the weight source of ``training_args`` never reads, or ``None``: with ``longce_weights`` 'cache', the
    short-context pass's settings (``SHORT_PASS_FIELDS``), since the weights are the evaluator's, scored
    with the cache's own K and d."""
    if training_args.longce_weights != "cache":
        return None
    unread = [name for name in SHORT_PASS_FIELDS if name in given]
    if not unread:
        return None
    return (
        f"{', '.join(unread)} {'has' if len(unread) == 1 else 'have'} no effect with longce_weights 'cache': the "
        "weights are the evaluator's, read from key_tokens, scored with the cache's own K and d (key_tokens_trunc_len "
        "and key_tokens_sliding_window choose among the cache's settings); drop "
        f"{'it' if len(unread) == 1 else 'them'} from the recipe and command line, or use longce_weights 'self'."
    )
