"""Fingerprints: short digests that tell whether stored key tokens belong to a text and an evaluator.

- ``text_fingerprint``: SHA-256 of the UTF-8 text.
- ``ModelIdentity``: who scored a text, i.e. the evaluator's name, revision, dtype and a fingerprint.
  There are two kinds of fingerprint, depending on how the evaluator is given:

  * a **checkpoint** (a Hub id or a local directory, as ``evaluator_model_id`` or in the scripts):
    a Hub id is identified by the commit its revision resolves to (which covers its tokenizer
    files); a folder converted from a GGUF file (``named``: a real model's short name or a
    ``*.gguf`` path) by that file's SHA-256 and its tokenizer files; another local directory by the bytes of its files: ``config.json`` and the tokenizer's files
    (``TOKENIZER_FILES``, ``*.model``, ``*.tiktoken``) whole, and of every weight file its name,
    size and ``CHECKPOINT_SAMPLES`` evenly spaced blocks of ``CHECKPOINT_BLOCK`` bytes. Nothing is
    loaded, so a cached corpus can be checked against an evaluator id without loading the
    evaluator. A folder is identified by its content, never by how its path is spelled.
  * a **model object**: its class, configuration (without name and version fields) and, for every
    parameter, its name, shape, dtype and ``WEIGHT_SAMPLES`` evenly strided values (as float32);
    and, when given, its tokenizer (:func:`tokenizer_fingerprint`: the fast tokenizer's whole
    pipeline, i.e. vocabulary, merges, normaliser, pre-tokenizer, post-processor such as an
    added BOS, and added tokens; or a slow tokenizer's class and vocabulary; plus the special
    tokens and the settings that change the ids, e.g. ``add_bos_token``).

  The tokenizer counts because the stored token ids and offsets are the tokenizer's: the same
  weights with another tokenizer score other tokens.

  Both kinds include the dtype the evaluator computes in, and, for an evaluator whose Linear layers
  compute in another precision (``evaluator_precision="fp8"``, ``precision``), that precision
  (:meth:`ModelIdentity.with_precision`): its rows are keyed apart from the bf16 rows of the same
  weights, and the bf16 identity is the one computed before precisions existed, so caches written
  then keep being found. Sampling keeps fingerprinting an 8B model
  at a fraction of a second instead of hashing 16 GB; it detects any change of configuration,
  shape, dtype, fine-tuning or merged adapter (which move every entry of the tensors they touch),
  but not an edit confined to entries between the samples. The same weights given once as a
  checkpoint and once as an object get different fingerprints (the two kinds never match), so
  such a cache is recomputed, never wrongly reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch only in annotations here: the key-token cache imports this module without it
    import torch
    from torch import nn

WEIGHT_SAMPLES = 4096  # values per parameter tensor
CHECKPOINT_SAMPLES = 64  # blocks per weight file
CHECKPOINT_BLOCK = 1 << 16  # bytes per block
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The files AutoTokenizer reads from a saved folder (besides config.json, hashed anyway).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
_TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken")
# Tokenizer settings that change the token ids of a text (not decoding or padding).
_TOKENIZER_SETTINGS = (
    "add_bos_token",
    "add_eos_token",
    "add_prefix_space",
    "do_lower_case",
    "legacy",
    "split_special_tokens",
)
# Config fields that name where a model came from or what wrote it, not what it computes.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")


def text_fingerprint(text: str) -> str:
    """SHA-256 hex digest of the UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 hex digest of what makes a tokenizer turn a text into ids (see the module docstring).

    Truncation and padding state of a fast tokenizer's backend are left out: they are per-call
    settings that the scorers set themselves.
    """
    digest = hashlib.sha256(b"longppl-tokenizer-v1\0")
    digest.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pipeline = json.loads(backend.to_str())
        pipeline.pop("truncation", None)
        pipeline.pop("padding", None)
        digest.update(json.dumps(pipeline, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    settings = {name: getattr(tokenizer, name, None) for name in _TOKENIZER_SETTINGS}
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """Who computed scores: ``name`` (Hub id or path, "" if unknown), ``revision`` (Hub commit, "" if
    none), ``dtype`` (e.g. ``"bfloat16"``) and ``fingerprint`` (hex digest; see the module docstring)."""

    name: str
    revision: str
    dtype: str
    fingerprint: str

    @classmethod
    def of_model(cls, model: nn.Module, tokenizer=None) -> "ModelIdentity":
        """Identity of a model object, from its configuration and sampled weights (no forward pass)
        and the tokenizer it scores with (pass it: without one, only the weights are identified).

        DDP / PEFT wrappers are looked through (LoRA weights injected into the model count), so a
        wrapped model has the fingerprint of the model it computes with.
        """
        from ..core.logprobs import unwrap_model

        model = unwrap_model(model)
        digest = hashlib.sha256(b"longppl-weights-v1\0")
        config = getattr(model, "config", None)
        digest.update(type(model).__name__.encode())
        if config is not None:
            fields = json.loads(config.to_json_string(use_diff=False))
            for key in _VOLATILE_CONFIG_KEYS:
                fields.pop(key, None)
            digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
        dtypes = set()
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            dtypes.add(dtype_name(param.dtype))
            digest.update(f"\0{name}:{tuple(param.shape)}:{param.dtype}".encode())
            if param.device.type != "meta":  # offloaded weights have no values here; name and shape still count
                flat = param.detach().reshape(-1)
                stride = max(1, flat.numel() // WEIGHT_SAMPLES)
                digest.update(flat[::stride][:WEIGHT_SAMPLES].float().cpu().numpy().tobytes())
        name = str(getattr(config, "_name_or_path", "") or "")
        dtype = "+".join(sorted(dtypes)) or "none"
        digest.update(dtype.encode())
        if tokenizer is not None:
            digest.update(f"\0tokenizer:{tokenizer_fingerprint(tokenizer)}".encode())
        return cls(name, "", dtype, "weights:" + digest.hexdigest())

    @classmethod
    def of_checkpoint(cls, name_or_path: str, dtype: torch.dtype) -> "ModelIdentity | None":
        """Identity of a checkpoint loaded in ``dtype``, without loading it.

        Returns ``None`` for a Hub id whose revision cannot be resolved to a commit (offline and not
        cached); the caller then loads the model and uses :meth:`of_model`.
        """
        from .named import resolve

        digest = hashlib.sha256(b"longppl-checkpoint-v1\0")
        digest.update(dtype_name(dtype).encode())
        folder = resolve(name_or_path) or name_or_path  # a short name or GGUF file: its converted folder
        if os.path.isdir(folder):
            revision = ""
            gguf = gguf_source(folder)
            if gguf is None:
                digest.update(_directory_digest(folder))
            else:  # converted from a GGUF (named): identified by that file's hash, not this copy's bytes
                digest = hashlib.sha256(b"longppl-checkpoint-gguf-v1\0")
                digest.update(dtype_name(dtype).encode())
                digest.update(f"gguf:{gguf}".encode())
                _hash_tokenizer_files(folder, digest)
        else:
            revision = _hub_commit(name_or_path)
            if revision is None:
                return None
            digest.update(f"{name_or_path}@{revision}".encode())
        return cls(str(name_or_path), revision, dtype_name(dtype), "checkpoint:" + digest.hexdigest())

    def with_precision(self, precision) -> "ModelIdentity":
        """This identity for the evaluator computing in ``precision`` (a ``settings.EvaluatorPrecision``,
        or its string).

        ``"bf16"`` (the evaluator as loaded): this identity itself, unchanged, so rows scored before
        precisions existed keep their key. Any other: the fingerprint of the same kind (``checkpoint:``
        or ``weights:``) hashed again with the precision, and the dtype ``"<dtype>+<precision>"``
        (``bfloat16+fp8``, shown by ``longppl cache info``), so such rows are never taken for the
        bf16 rows of the same weights, nor those for them.
        """
        from ..settings import EvaluatorPrecision

        precision = EvaluatorPrecision.of(precision).value  # a member passes unchecked
        if precision == EvaluatorPrecision.BF16:
            return self
        kind, _, digest = self.fingerprint.partition(":")
        tagged = hashlib.sha256(f"longppl-precision-v1\0{precision}\0{digest}".encode()).hexdigest()
        return ModelIdentity(self.name, self.revision, f"{self.dtype}+{precision}", f"{kind}:{tagged}")


def _hub_commit(repo_id: str) -> str | None:
    """The commit a Hub repository's default revision points to, or ``None``."""
    try:
        from transformers.utils.hub import resolve_revision
    except ImportError:  # older transformers
        return None
    try:
        commit = resolve_revision(repo_id, None)
    except Exception:  # noqa: BLE001 - unresolvable (offline, gated, unknown) means "unknown"
        return None
    commit = str(commit) if commit is not None else ""
    return commit if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit) else None


def saved_model_files(folder: str) -> dict[str, list[str]]:
    """The names of the files of ``folder`` a saved model is made of: ``{"config": [...],
    "tokenizer": [...], "weights": [...]}`` (each list empty when there are none)."""
    names = sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name)))
    return {
        "config": [name for name in names if name == "config.json"],
        "tokenizer": [name for name in names if name in TOKENIZER_FILES or name.endswith(_TOKENIZER_FILE_SUFFIXES)],
        "weights": [name for name in names if name.endswith(_WEIGHT_FILE_SUFFIXES)],
    }


def file_sha256(path: str, block_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in blocks of ``block_bytes``."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()


def gguf_source(folder: str) -> str | None:
    """The SHA-256 of the GGUF file a folder was converted from (``named``), else ``None``."""
    from .named import source_sha256

    return source_sha256(folder)


def _hash_tokenizer_files(folder: str, digest) -> None:
    """Feed ``digest`` the names and bytes of a saved folder's tokenizer files."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if (name in TOKENIZER_FILES or name.endswith(_TOKENIZER_FILE_SUFFIXES)) and os.path.isfile(path):
            with open(path, "rb") as handle:
                digest.update(f"\0tokenizer:{name}:".encode() + handle.read())


def _directory_digest(folder: str) -> bytes:
    """Digest of a saved model folder: its config and tokenizer files, and sampled blocks of its
    weight files."""
    digest = hashlib.sha256()
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as handle:
            digest.update(handle.read())
    _hash_tokenizer_files(folder, digest)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not (name.endswith(_WEIGHT_FILE_SUFFIXES) and os.path.isfile(path)):
            continue
        size = os.path.getsize(path)
        digest.update(f"\0{name}:{size}".encode())
        with open(path, "rb") as handle:
            if size <= CHECKPOINT_SAMPLES * CHECKPOINT_BLOCK:
                digest.update(handle.read())
                continue
            for start in np.linspace(0, size - CHECKPOINT_BLOCK, CHECKPOINT_SAMPLES).astype(np.int64):
                handle.seek(int(start))
                digest.update(handle.read(CHECKPOINT_BLOCK))
    return digest.digest()
