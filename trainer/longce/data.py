"""The data of ``longce-train``: its tokenizer, and the training / evaluation sequences of a text dataset.

Sequences are built either run_clm-style (documents tokenized, joined with EOS, cut into
``max_seq_length`` blocks, with ``labels``) or, with ``packing``, per document (each document, EOS
appended, cut into pieces of at most ``max_seq_length`` tokens) for ``DataCollatorWithFlattening``:
position ids then restart at every piece, so no attention and no LongCE short-context window crosses a
document. Evaluation text comes from ``eval_data_files``, a split of the training source
(``eval_split``), or the first ``validation_split_percentage`` percent of the training documents.

With ``key_tokens`` (``longce_weights: cache``) the documents are tokenized by
``longce.add_key_token_weights``, which adds a ``longce_weights`` column, one weight per token of
``input_ids`` (the EOS, which the evaluator never scored, weighs ``min(1, gamma)``); grouping and splitting cut it with the same slices as
``input_ids``, so every weight stays with its token.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import datasets
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from longppl.models.named import resolve
from longppl.settings import KeyTokenRule

# the checks of a data file and of a key-token folder are the ones the command runs before torch loads
from .recipes import DATA_FILE_BUILDERS, check_data_file, check_key_tokens_folder  # noqa: F401
from .script_arguments import BYTE_LEVEL, DataArguments, ModelArguments

if TYPE_CHECKING:
    from longppl.cache.key_token_cache import KeyTokenCache


# ------------------------------------------------------------------ tokenizer


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
        else AutoTokenizer.from_pretrained(
            resolve(name, "tokenizer_name_or_path") or name, cache_dir=model_args.cache_dir
        )
    )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"Tokenizer {name!r} has no EOS token; documents are separated by EOS. Use a tokenizer "
            "with one (or add one and resize the model's embeddings)."
        )
    return tokenizer


# ------------------------------------------------------------------ datasets


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
            suffixes.add(check_data_file(path, files_field))
        if len(suffixes) > 1:
            raise ValueError(f"{files_field} mixes formats {sorted(suffixes)}; give files of one format.")
        raw = datasets.load_dataset(
            suffixes.pop(), data_files=list(data_args.data_files), split=data_args.dataset_split, cache_dir=cache_dir
        )
    if data_args.text_column not in raw.column_names:
        raise ValueError(
            f"Text column {data_args.text_column!r} not found in {data_args.source_name}; its columns "
            f"are {raw.column_names}. Set text_column to one of them."
        )
    feature = raw.features[data_args.text_column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(
            f"Text column {data_args.text_column!r} of {data_args.source_name} holds {feature}, not "
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
                    f"Row {index} of {data_args.source_name} has {text!r} in text column {column!r}; "
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


def load_key_token_cache(data_args: DataArguments) -> KeyTokenCache | None:
    """The key-token cache of ``key_tokens`` (``None`` without one); a missing folder is an error."""
    if data_args.key_tokens is None:
        return None
    path = data_args.key_tokens
    check_key_tokens_folder(path)
    from longppl.cache.key_token_cache import KeyTokenCache

    return KeyTokenCache.load(path)


def weigh_documents(
    raw: datasets.Dataset,
    tokenizer,
    data_args: DataArguments,
    key_tokens: KeyTokenCache,
    rule: KeyTokenRule,
    what: str,
) -> datasets.Dataset:
    """``input_ids`` and ``longce_weights`` of every document (``add_key_token_weights``: the soft ``rule``'s
    weights, ``LongCEConfig.longce_rule``), EOS appended (weight ``min(1, gamma)``), as
    ``tokenize_documents`` tokenizes them."""
    from .cached_weights import add_key_token_weights
    from .weight_sources import WEIGHTS_COLUMN

    try:
        weighed = add_key_token_weights(
            raw,
            key_tokens=key_tokens,
            tokenizer=tokenizer,
            rule=rule,
            text_column=data_args.text_column,
            append_eos=True,
            evaluator=data_args.key_tokens_evaluator,
            trunc_len=data_args.key_tokens_trunc_len,
            sliding_window=data_args.key_tokens_sliding_window,
            batch_size=data_args.preprocessing_batch_size,
        )
    except ValueError as err:
        raise ValueError(
            f"LongCE weights of the {what} data {data_args.source_name} from key_tokens {key_tokens.path!r}: "
            f"{err} (In longce-train: key_tokens_evaluator, key_tokens_trunc_len and key_tokens_sliding_window "
            f"choose the cache's rows; longppl-score --corpus <the texts> --evaluator <model> --output "
            f"{key_tokens.path} scores missing texts into it.)"
        ) from err
    return weighed.remove_columns([name for name in raw.column_names if name not in ("input_ids", WEIGHTS_COLUMN)])


def build_sequences(
    raw: datasets.Dataset,
    tokenizer,
    data_args: DataArguments,
    max_samples: int | None = None,
    what: str = "training",
    key_tokens: KeyTokenCache | None = None,
    rule: KeyTokenRule | None = None,
) -> datasets.Dataset:
    """Sequences of ``raw``: run_clm-style blocks with ``labels``, or per-document pieces (``packing``).

    ``max_samples`` keeps the first N sequences; ``what`` ("training", "evaluation") names them in errors.
    With ``key_tokens`` (the cache of ``data_args.key_tokens``, ``load_key_token_cache``) the sequences
    also hold ``longce_weights``, cut like ``input_ids`` (the soft ``rule``'s weights; ``None``: the
    paper's, gamma 5).
    """
    if key_tokens is None:
        documents = tokenize_documents(raw, tokenizer, data_args)
    else:
        documents = weigh_documents(raw, tokenizer, data_args, key_tokens, rule or KeyTokenRule(soft=True), what)
    length = data_args.max_seq_length
    columns = documents.column_names  # input_ids, and longce_weights: token columns, cut alike

    def group(batch: dict[str, list]) -> dict[str, list]:
        # run_clm: the tail of each map batch that does not fill a block is dropped.
        out = {}
        for name in columns:
            values = list(chain.from_iterable(batch[name]))
            out[name] = [values[i : i + length] for i in range(0, len(values) - length + 1, length)]
        return {**out, "labels": [list(block) for block in out["input_ids"]]}

    def split(batch: dict[str, list]) -> dict[str, list]:
        # (document, start) of each piece; a piece with one token has nothing to predict.
        pieces = [(d, i) for d, doc in enumerate(batch["input_ids"]) for i in range(0, len(doc) - 1, length)]
        return {name: [batch[name][d][i : i + length] for d, i in pieces] for name in columns}

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
            f"{data_args.source_name} gives no {what} sequence: {total} tokens in all, fewer than "
            f"max_seq_length={length}. Use more data, a smaller max_seq_length or packing: true."
        )
    if max_samples is not None:
        sequences = sequences.select(range(min(max_samples, len(sequences))))
    return sequences


def build_train_dataset(
    raw: datasets.Dataset,
    tokenizer,
    data_args: DataArguments,
    key_tokens: KeyTokenCache | None = None,
    rule: KeyTokenRule | None = None,
) -> datasets.Dataset:
    """Training sequences of ``raw`` (``build_sequences`` with ``max_train_samples``)."""
    return build_sequences(raw, tokenizer, data_args, data_args.max_train_samples, "training", key_tokens, rule)


def load_datasets(
    data_args: DataArguments, tokenizer, cache_dir: str | None = None, rule: KeyTokenRule | None = None
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Training and evaluation sequences (``None`` without evaluation data), built the same way.

    Evaluation text comes from ``eval_data_files`` (split ``eval_split``, default all of them), from
    split ``eval_split`` of the training source, or from the first ``validation_split_percentage``
    percent of the training split's documents, which training then leaves out (as run_clm does).
    With ``key_tokens`` both get ``longce_weights`` from that cache, the soft ``rule``'s weights (the
    config's: ``training_args.longce_rule``; ``None``: the paper's, gamma 5).
    """
    key_tokens = load_key_token_cache(data_args)  # first: a missing cache fails before any tokenization
    raw = load_text_dataset(data_args, cache_dir)
    eval_raw = None
    if data_args.validation_split_percentage is not None:
        count = round(len(raw) * data_args.validation_split_percentage / 100)
        if not 0 < count < len(raw):
            raise ValueError(
                f"validation_split_percentage={data_args.validation_split_percentage} of the "
                f"{len(raw)} documents of {data_args.source_name} leaves "
                f"{'no evaluation' if count == 0 else 'no training'} document; use another percentage "
                "or eval_data_files."
            )
        eval_raw, raw = raw.select(range(count)), raw.select(range(count, len(raw)))
    elif data_args.has_eval_data:
        source = data_args.eval_source()
        eval_raw = load_text_dataset(
            source, cache_dir, "eval_data_files" if data_args.eval_data_files else "data_files"
        )
    train = build_train_dataset(raw, tokenizer, data_args, key_tokens, rule)
    if eval_raw is None:
        return train, None
    source = data_args.eval_source() if data_args.validation_split_percentage is None else data_args
    return train, build_sequences(
        eval_raw, tokenizer, source, data_args.max_eval_samples, "evaluation", key_tokens, rule
    )
