"""The fields of ``longce-train``: ``ModelArguments``, ``DataArguments`` and ``RecipeConfig``, declared once.

As TRL's ``ModelConfig`` and ``ScriptArguments`` beside its ``SFTConfig``: the model to train (its
context extension, its LoRA adapter), where the text comes from and how it becomes sequences, and
``RecipeConfig`` (``LongCEConfig`` plus the command's own fields). Each checks its values when built;
``check_combination`` checks what the data and training arguments must agree on. The parser that
fills them from a YAML recipe and the command line is ``longce.arguments``; ``longce.recipes`` reads
their field names from this file's source before torch is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from .config import LongCEConfig
from .context_extension import METHODS
from .weight_sources import WEIGHTS_COLUMN, weight_source_for

BYTE_LEVEL = "byte-level"
# Names of the model weights' dtypes (``longce.models.load_model`` maps them to torch dtypes).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# DataArguments fields that choose rows of the key_tokens cache (an evaluator, its settings).
KEY_TOKENS_CHOICES = ("key_tokens_evaluator", "key_tokens_trunc_len", "key_tokens_sliding_window")


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


def check_combination(data_args: DataArguments, training_args: LongCEConfig) -> None:
    """What the data and training arguments must agree on, a ``ValueError`` saying what to set:
    ``eval_strategy`` other than no needs evaluation data; ``key_tokens`` goes with ``longce_weights``
    'cache' (:func:`check_weight_source`)."""
    if training_args.eval_strategy != "no" and not data_args.has_eval_data:
        raise ValueError(
            f"eval_strategy={training_args.eval_strategy.value!r} needs evaluation data: set "
            "eval_data_files (local files), eval_split (a split of the training source, e.g. "
            "'validation') or validation_split_percentage (hold out a share of the training documents)."
        )
    check_weight_source(data_args, training_args)


def check_weight_source(data_args: DataArguments, training_args: LongCEConfig) -> None:
    """``key_tokens`` is given exactly when the weight source reads the ``longce_weights`` column that the
    recipe builds from it (``longce_weights: cache``); a ``ValueError`` says what to set."""
    source = weight_source_for(training_args)
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
