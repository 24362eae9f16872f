"""Recipes of ``longce-train`` read, and what the command line names checked, before torch is imported.

``longce-train`` / ``longppl train`` parse their arguments with transformers' ``HfArgumentParser``
into dataclasses built on ``TrainingArguments``, whose import loads torch: seconds on an idle
machine, minutes on a loaded one. The mistakes a user makes most (a recipe path that does not
exist, a recipe that does not parse, a misspelled field in the recipe or option on the command
line, a data file or key-token cache folder that is not there) need none of it, so
:func:`check_before_loading` answers them first, with the same one-line messages the full parse
gives (``longce.arguments`` builds its messages with the functions here).

The valid field names are read from the source of the argument dataclasses (``ast``, nothing
imported): transformers' ``TrainingArguments`` and this package's ``ModelArguments``,
``DataArguments``, ``LongCEConfig`` and ``RecipeConfig``. Where a source cannot be read (a
transformers release that moved the class), the name check is left to the full parse, which
refuses the same names: the early check only ever refuses what the full parse refuses.

Standard library and ``yaml`` only: nothing here may import torch, transformers or datasets.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import os
from typing import Any

from longppl.commandline.running import long_options, read_yaml_file

#: The command's name in messages when it is called from Python (``longce.cli.train``); a command
#: started by its name shows that name (``longppl train``, ``longce-train``).
PROG = "longce-train"

#: Local data files by suffix -> the ``datasets`` builder that reads them.
DATA_FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
    ".csv": "csv",
}

#: The argument dataclasses of the command, ``(module, class)``: ``module`` is a file of this package
#: or a module of transformers, read as source text.
ARGUMENT_CLASSES = (
    ("script_arguments", "ModelArguments"),
    ("script_arguments", "DataArguments"),
    ("script_arguments", "RecipeConfig"),
    ("config", "LongCEConfig"),
    ("transformers.training_args", "TrainingArguments"),
)

#: The options of the command itself, besides the fields.
OWN_OPTIONS = ("-h", "--help", "--config", "--help-all", "--help_all")


def load_recipe(path: str) -> dict[str, Any]:
    """The YAML mapping of a recipe file (``yaml.safe_load``: plain data only), read by
    ``longppl.commandline.running.read_yaml_file`` (a file that does not parse is a ``ValueError`` naming it)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Config file {path!r} not found (--config takes a YAML recipe, e.g. configs/tiny_cpu.yaml)."
        )
    recipe = read_yaml_file(path)
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


#: The recipe fields naming local files, relative to the recipe's folder (``key_tokens`` too, one folder).
RECIPE_PATHS = ("data_files", "eval_data_files", "train_file", "validation_file")


def read_recipe_file(path: str, valid: set[str] | None, prog: str = PROG) -> dict[str, Any]:
    """The recipe at ``path`` (:func:`load_recipe`), its keys checked and its paths resolved: the one
    reading of a recipe, before torch (``check_before_loading``) and in the full parse.

    Keys not in ``valid`` (the fields; ``None``: not checked) are a ``ValueError`` naming them
    (``prog``: the command's name in it). A recipe's ``RECIPE_PATHS`` and ``key_tokens`` are made
    relative to its folder, so it runs from any directory; paths given on the command line stay
    relative to the current directory, as usual.
    """
    recipe = load_recipe(path)
    unknown = sorted(set(recipe) - valid) if valid is not None else []
    if unknown:
        raise ValueError(unknown_fields_message(unknown, path, prog))
    for key in RECIPE_PATHS:
        if recipe.get(key):
            recipe[key] = resolve_recipe_paths(recipe[key], path)
    if isinstance(recipe.get("key_tokens"), str):
        recipe["key_tokens"] = resolve_recipe_paths(recipe["key_tokens"], path)[0]
    return recipe


def unknown_fields_message(unknown: list[str], path: str, prog: str = PROG) -> str:
    """The error for recipe keys that are no field."""
    return (
        f"Unknown field(s) {sorted(unknown)} in {path!r}; see `{prog} --help-all` "
        "for the valid ones (ModelArguments, DataArguments, LongCEConfig)."
    )


def unknown_arguments_message(remaining: list[str], options: list[str], prog: str = PROG) -> str:
    """The error for arguments no field takes: each unknown option with the closest of ``options``."""
    from longppl.commandline.running import with_closest_option

    named = [arg.split("=", 1)[0] for arg in remaining if arg.startswith("-")]
    if not named:
        return (
            f"unexpected argument(s) {' '.join(remaining)}: a value follows the --FIELD it sets; "
            f"`{prog} --help` lists the fields."
        )
    return f"unknown option(s) {with_closest_option(named, options)}; `{prog} --help-all` lists every field."


def options_of_fields(fields: dict[str, bool]) -> list[str]:
    """Every option of the fields ``{name: defaults to True}``, as ``HfArgumentParser`` declares them:
    ``--a_b`` and ``--a-b``, and ``--no_a_b`` / ``--no-a-b`` for a boolean field that defaults to ``True``."""
    options = []
    for name, default_true in fields.items():
        names = [name] + (["no_" + name] if default_true else [])
        options += [f"--{spelling}" for one in names for spelling in {one, one.replace("_", "-")}]
    return sorted(options)


def check_data_file(path: str, files_field: str) -> str:
    """The ``datasets`` builder of the local data file ``path`` (``DATA_FILE_BUILDERS``); a ``ValueError``
    for a suffix no builder reads, a ``FileNotFoundError`` for a file that is not there (a glob pattern
    is left to ``datasets``). ``files_field``: the field that named it, for the messages."""
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
    return DATA_FILE_BUILDERS[suffix]


def check_key_tokens_folder(path: str) -> None:
    """A ``FileNotFoundError`` saying how to make it when ``key_tokens`` names no folder."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"key_tokens: no key-token cache folder at {path!r} (on the command line relative paths are "
            f"relative to the current directory, {os.getcwd()}; in a recipe, to the recipe's folder). Score "
            f"the training and evaluation texts into it first: longppl-score --corpus <the texts> --evaluator "
            f"<model> --output {path}"
        )


@functools.cache
def source_fields() -> dict[str, bool] | None:
    """``{field name: defaults to True}`` of every ``init`` field of the ``ARGUMENT_CLASSES``, read from
    their source files without importing them; ``None`` when one cannot be read."""
    found: dict[str, bool] = {}
    for module, name in ARGUMENT_CLASSES:
        fields = _dataclass_fields(_source_path(module), name)
        if fields is None:
            return None
        found.update(fields)
    return found


def _source_path(module: str) -> str | None:
    if "." not in module:  # a module of this package
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{module}.py")
    top, rest = module.split(".", 1)
    try:
        spec = importlib.util.find_spec(top)  # a top-level package: found, not imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], *rest.split(".")) + ".py"


def _dataclass_fields(path: str | None, name: str) -> dict[str, bool] | None:
    """The fields a class ``name`` of the file ``path`` declares in its body (annotated names, less
    ``ClassVar`` and ``field(init=False)``), each with whether its default is ``True``."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            break
    else:
        return None
    fields = {}
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(item.annotation):
            continue
        value, default = item.value, item.value
        if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
            keywords = {k.arg: k.value for k in value.keywords}
            if isinstance(keywords.get("init"), ast.Constant) and keywords["init"].value is False:
                continue
            default = keywords.get("default")
        fields[item.target.id] = isinstance(default, ast.Constant) and default.value is True
    return fields


def _recipe_paths(recipe: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    value = next((recipe[name] for name in names if recipe.get(name) is not None), None)
    return [] if value is None else [value] if isinstance(value, str) else list(value)


class _FirstPass(argparse.ArgumentParser):
    """The command's own options and those naming local paths, read before the full parse."""

    def error(self, message: str):  # the full parse reports a malformed option
        raise _Unreadable


class _Unreadable(Exception):
    pass


def first_pass(argv: list[str]) -> argparse.Namespace | None:
    """What the command reads from ``argv`` before its full parse, with torch or without: ``config``,
    ``help``, ``help_all``, and the options naming local paths (``data_files``, ``eval_data_files`` and
    their other names, ``key_tokens``) or deciding whether they are read (``longce_weights``,
    ``dataset_name``); ``None`` where ``argv`` is malformed (e.g. ``--config`` without its value), which
    the full parse then reports."""
    pre = _FirstPass(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("-h", "--help", action="store_true")
    pre.add_argument("--help-all", "--help_all", action="store_true")
    for names in (("data_files", "train_file"), ("eval_data_files", "validation_file")):
        spellings = [f"--{spelling}" for name in names for spelling in dict.fromkeys((name, name.replace("_", "-")))]
        pre.add_argument(*spellings, dest=names[0], nargs="+")
    pre.add_argument("--key_tokens", "--key-tokens")
    pre.add_argument("--longce_weights", "--longce-weights")
    pre.add_argument("--dataset_name", "--dataset-name")
    try:
        return pre.parse_known_args(argv)[0]
    except _Unreadable:
        return None


def check_before_loading(argv: list[str], prog: str = PROG) -> None:
    """What ``longce-train argv`` would refuse that needs no torch, refused before it is imported.

    In this order, each a one-line ``ValueError`` / ``FileNotFoundError`` as the full parse words it:
    a ``--config`` file that is missing, does not parse or holds no mapping; recipe keys that are no
    field; options no field takes (an abbreviation of a field's option is left to argparse); data files
    (``data_files``, ``eval_data_files`` and their other names) with a suffix no builder reads or that
    are not there, and, with ``longce_weights`` 'cache', a ``key_tokens`` folder that is not there, each
    as the command line or else the recipe gives it (a recipe's paths relative to its folder).
    ``--help`` is left alone.
    """
    known = first_pass(argv)
    if known is None or known.help or known.help_all:
        return  # malformed (e.g. `--config` without its value): the full parse says so
    fields = source_fields()
    recipe = read_recipe_file(known.config, fields and set(fields), prog) if known.config is not None else {}
    if fields is not None:
        options = options_of_fields(fields)
        valid = set(options) | set(OWN_OPTIONS)
        # a prefix of a valid option is argparse's abbreviation (or ambiguity): the full parse decides
        strays = [name for name in long_options(argv) if not any(option.startswith(name) for option in valid)]
        if strays:
            raise ValueError(unknown_arguments_message(strays, options, prog))

    training = known.data_files
    if training is None and known.dataset_name is None:
        training = _recipe_paths(recipe, ("data_files", "train_file"))
    evaluation = known.eval_data_files
    if evaluation is None:
        evaluation = _recipe_paths(recipe, ("eval_data_files", "validation_file"))
    for files_field, paths in (("data_files", training or []), ("eval_data_files", evaluation)):
        for path in paths:
            if "://" not in path:
                check_data_file(path, files_field)
    key_tokens = known.key_tokens
    if key_tokens is None and isinstance(recipe.get("key_tokens"), str):
        key_tokens = recipe["key_tokens"]
    weights = known.longce_weights if known.longce_weights is not None else recipe.get("longce_weights")
    if key_tokens is not None and weights == "cache":  # without cached weights, key_tokens is the error
        check_key_tokens_folder(key_tokens)
