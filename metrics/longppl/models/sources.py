"""Where a name given for a model, a corpus or a key-token cache points: a local path or a Hub repository.

Every entry point decides this with :func:`locate` (models through :func:`check_model_source`),
once, before anything heavy is imported or loaded, so that a typo fails in a second with one line
instead of a minute of Hub retries and a traceback. The rule (docs/design.md, "Local paths and Hub
ids"):

1. A path that exists here is local.
2. A name that is not a Hub id (``'name'`` or ``'org/name'``: it starts with ``./``, ``../``, ``/``
   or ``~``, has two slashes, a backslash, a drive letter...) is a local path that does not exist:
   an error, and the Hub is never asked.
3. A Hub id in the local Hugging Face cache is used from there (whatever the network).
4. Offline (``HF_HUB_OFFLINE=1``), any other Hub id is an error.
5. Otherwise the Hub is asked once, with a short timeout and no retries, whether the repository
   exists (huggingface_hub's own HTTP client, so proxies and ``HF_ENDPOINT`` apply): no answer, or
   "no such repository", is an error. The answer "it exists" is remembered for the process.

Only the standard library and huggingface_hub are imported here: the commands run this before torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Seconds to wait for the Hub's answer about one repository (once; there are no retries).
HUB_TIMEOUT_S = 5.0
_KINDS = {"model": "model", "dataset": "dataset"}
# (repo_type, repo_id) of the repositories the Hub said exist, so that a name checked at a
# command's start and again when it is loaded costs one request.
_FOUND_ON_HUB: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Location:
    """Where :func:`locate` found a name: ``local`` (``path`` is the existing path, ``~`` expanded)
    or on the Hub (``path`` is the repository id)."""

    name: str
    local: bool
    path: str


def env_flag(name: str, environ=None) -> bool:
    """Whether the environment variable ``name`` is switched on (1, true, yes or on, any case)."""
    return (os.environ if environ is None else environ).get(name, "").strip().lower() in ("1", "on", "yes", "true")


def require_path(name: str, argument: str, example: str) -> str:
    """``name``, refused when it is empty or blank: ``os.path`` reads ``''`` as the current folder, so an
    unset shell variable (``--output "$OUT"``) would write there. Checked by every option that names a
    folder to write (a key-token cache, a reproduction's run folder).

    Raises:
        ValueError: ``<argument>='' is empty: pass <example>.``
    """
    if not name.strip():
        raise ValueError(f"{argument}={name!r} is empty: pass {example}.")
    return name


def hub_offline() -> bool:
    """Whether the Hub may not be used (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    # Read the environment now too: huggingface_hub reads it once, at import.
    env = env_flag("HF_HUB_OFFLINE") or env_flag("TRANSFORMERS_OFFLINE")
    return env or bool(constants.HF_HUB_OFFLINE)


def hub_cache_dirs() -> list[str]:
    """The folders huggingface_hub keeps downloads in, as the environment names them now."""
    from huggingface_hub import constants

    dirs = []
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            dirs.append(os.path.expanduser(os.environ[name]))
    if os.environ.get("HF_HOME"):
        dirs.append(os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub"))
    dirs.append(constants.HF_HUB_CACHE)
    return list(dict.fromkeys(dirs))


def _datasets_cache_dir() -> str:
    # datasets' own cache of prepared datasets, where load_dataset also looks while offline (as
    # datasets.config computes it, without importing datasets).
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "datasets")


def in_local_cache(repo_id: str, repo_type: str = "model") -> bool:
    """Whether a download of the Hub repository ``repo_id`` is in the local Hugging Face cache."""
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    for cache in hub_cache_dirs():
        snapshots = os.path.join(cache, folder, "snapshots")
        if os.path.isdir(snapshots) and os.listdir(snapshots):
            return True
    if repo_type == "dataset":
        # datasets names its folders 'org___name', the name in snake case: compare without case and '_'.
        def plain(text):
            return text.lower().replace("_", "")

        wanted = plain(repo_id.replace("/", "___"))
        root = _datasets_cache_dir()
        return os.path.isdir(root) and any(plain(entry) == wanted for entry in os.listdir(root))
    return False


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    # Explicit path syntax first: such a name is a local path whatever validate_repo_id accepts.
    if name.startswith(("./", "../", "/", "~", ".\\", "..\\")) or name in (".", "..") or os.path.isabs(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _named(argument: str, name: str) -> str:
    return f"{argument} {name!r}" if argument.startswith("-") else f"{argument}={name!r}"


def _ask_hub(repo_id: str, repo_type: str) -> str | None:
    """``None`` when the Hub says the repository exists, else why it cannot be used (one clause)."""
    if (repo_type, repo_id) in _FOUND_ON_HUB:
        return None
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    kind = _KINDS[repo_type]
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        pass  # it exists; downloading needs access, which the download itself will say
    except RepositoryNotFoundError:
        return (
            f"nor a {kind} on the Hub ({constants.ENDPOINT} has no {kind} repository {repo_id!r}, or it is "
            "private and this machine is not logged in: `hf auth login`)"
        )
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", "?")
        return f"and the Hub could not say whether it is a {kind} there ({constants.ENDPOINT} answered HTTP {status})"
    except Exception as err:  # noqa: BLE001 - the HTTP client's connection errors (requests, httpx, httpx2 by version)
        reason = (str(err).splitlines() or [""])[0][:120]
        return (
            f"and the Hub could not be reached to look it up as a {kind} id ({constants.ENDPOINT}: "
            f"{type(err).__name__}: {reason}), nor is it in the local Hugging Face cache; check the name, "
            "or the network (a proxy: HTTPS_PROXY)"
        )
    _FOUND_ON_HUB.add((repo_type, repo_id))
    return None


def locate(name, repo_type: str = "model", argument: str = "model_id", hint: str = "") -> Location:
    """Decide whether ``name`` is a local path or a Hub repository of ``repo_type``, by the rule of
    this module's docstring, asking the Hub at most once.

    Args:
        repo_type: ``"model"`` (models and tokenizers) or ``"dataset"`` (corpora, key-token caches).
        argument: the argument or flag that gave ``name``, for the message (``"--corpus"``,
            ``"evaluator_model_id"``).
        hint: what to pass instead, ending the message.
    Raises:
        ValueError: one line naming ``argument``, ``name`` and why it is neither here nor usable on
            the Hub.
    """
    if not isinstance(name, (str, os.PathLike)) or not str(name).strip():
        raise ValueError(f"{argument} must be a Hub id such as 'org/name' or a local path, got {name!r}.")
    name = os.fspath(name)
    local = os.path.expanduser(name)
    if os.path.exists(local):
        return Location(name, True, local)
    kind = _KINDS[repo_type]
    missing = f"{_named(argument, name)} is not an existing directory (no such path here)"
    hint = f": {hint}" if hint else "."
    if not _is_hub_id(name):
        raise ValueError(f"{missing}, nor a Hub id ('name' or 'org/name'), so it was not looked up on the Hub{hint}")
    if in_local_cache(name, repo_type):
        return Location(name, False, name)
    if hub_offline():
        download = f"hf download {name}" + (" --repo-type dataset" if repo_type == "dataset" else "")
        raise ValueError(
            f"{missing}, and as a Hub {kind} id it is not in the local Hugging Face cache ({hub_cache_dirs()[0]}), "
            f"which is all that can be used while offline (HF_HUB_OFFLINE=1): download it once with network "
            f"access (`{download}`), or pass the path of a local copy."
        )
    problem = _ask_hub(name, repo_type)
    if problem is not None:
        raise ValueError(f"{missing}, {problem}{hint}")
    return Location(name, False, name)


def locate_cache(source, argument: str = "key_tokens") -> Location:
    """Where the key-token cache ``source`` is: a local directory, or a Hub dataset id (:func:`locate`)."""
    from ..atomic_files import swap_interrupted

    # A swap killed between its two renames leaves only the previous copy (``.NAME.previous``):
    # still a local cache, which KeyTokenCache.load recovers; never a name to look up on the Hub.
    if isinstance(source, (str, os.PathLike)) and str(source).strip() and swap_interrupted(os.fspath(source)):
        return Location(os.fspath(source), True, os.fspath(source))
    hint = "pass the directory longppl-score wrote, or the Hub dataset id a cache was pushed to."
    return locate(source, "dataset", argument, hint)


def check_model_source(name_or_path, argument: str = "model_id", tokenizer: bool = False) -> str:
    """``name_or_path`` as a string, after checking that a model can be loaded from it: a local
    directory holding a saved model or tokenizer, or a Hub model id that exists (see :func:`locate`);
    for a real model's short name (``gemma-3-270m``, ``smollm2-135m``) or a ``*.gguf`` file, the
    folder it is converted into (``named.resolve``; converted on first use). Loaders use the
    returned string.

    Args:
        argument: the argument's name, for the message (e.g. ``"evaluator_model_id"``).
        tokenizer: a tokenizer is loaded from it, so a local directory must hold tokenizer files.
    Raises:
        ValueError: saying what was wrong with ``name_or_path`` and what to pass.
    """
    from .fingerprints import saved_model_files
    from .named import NAMED_MODELS, close_name, resolve

    # A short name of a real model shipped by a registry package, or a GGUF file: its converted folder.
    folder = resolve(name_or_path, argument)
    if folder is not None:
        return folder
    how = "pass the directory a model was saved to with save_pretrained, or a Hub model id"
    if isinstance(name_or_path, str) and not os.path.exists(os.path.expanduser(name_or_path)):
        near = close_name(name_or_path)
        if near is not None and not in_local_cache(name_or_path):
            raise ValueError(
                f"{_named(argument, name_or_path)} is not a local path, nor a model short name: did you mean "
                f"{near!r}? (short names: {', '.join(NAMED_MODELS)}; else {how}.)"
            )
    location = locate(name_or_path, "model", argument, how + " (or a short name: " + ", ".join(NAMED_MODELS) + ").")
    if not location.local:
        return location.name
    named = _named(argument, location.name)
    if not os.path.isdir(location.path):
        raise ValueError(f"{named} is a file; pass the directory a model was saved to with save_pretrained.")
    files = saved_model_files(location.path)
    empty = not any(files.values())
    if empty or (tokenizer and not files["tokenizer"]):
        held = sorted(os.listdir(location.path))
        shown = (", ".join(held[:8]) + (", ..." if len(held) > 8 else "")) if held else "nothing"
        what = "model or tokenizer files" if empty else "tokenizer files"
        raise ValueError(
            f"{named} is a folder with no {what} (no tokenizer.json or tokenizer_config.json"
            f"{', no config.json, no weights' if empty else ''}; it holds {shown}): pass the directory a model and "
            "its tokenizer were saved to (model.save_pretrained and tokenizer.save_pretrained), or a Hub model id."
        )
    return location.name
