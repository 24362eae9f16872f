"""The parser of ``longce-train``: a YAML recipe and the command line into its argument dataclasses.

The dataclasses are ``longce.script_arguments``'s (importable from here too). A recipe (``--config recipe.yaml``) sets fields of ``ModelArguments``, ``DataArguments`` and
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
import sys
from dataclasses import MISSING, field, fields, make_dataclass
from typing import Any, get_type_hints

from transformers import HfArgumentParser

from .config import LongCEConfig

# The reading of a recipe and the messages for names no field has need no torch: they live in
# `recipes`, which the command runs before this module is imported (`recipes.check_before_loading`).
# PROG: the command's name in messages when it is called from Python; a command shows the name it
# was started by (`longppl train`, `longce-train`), passed on as `prog`.
from .recipes import (  # noqa: F401  (load_recipe, resolve_recipe_paths: importable from here as before)
    PROG,
    first_pass,
    load_recipe,
    options_of_fields,
    read_recipe_file,
    resolve_recipe_paths,
    unknown_arguments_message,
)
from .script_arguments import (  # noqa: F401  (the fields, importable from here as before)
    BYTE_LEVEL,
    DTYPES,
    KEY_TOKENS_CHOICES,
    DataArguments,
    ModelArguments,
    RecipeConfig,
    check_combination,
    check_weight_source,
)

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
# Shown by --help besides ModelArguments and DataArguments (--help-all: every LongCEConfig field).
LONGCE_PREFIX = "longce_"


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
        """Every option of a field, as ``HfArgumentParser`` declares them (``recipes.options_of_fields``)."""
        return options_of_fields(
            {spec.name: spec.default is True for cls in self.dataclass_types for spec in fields(cls) if spec.init}
        )

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
    """The recipe at ``path``, checked and ready to be the parser's defaults: read as before torch
    (``recipes.read_recipe_file``: unknown keys are a ``ValueError``, ``prog`` the command's name in it;
    local paths relative to the recipe's folder), then each ``ALIASES`` group merged (``merge_aliases``).
    """
    valid = {f.name for cls in (ModelArguments, DataArguments, RecipeConfig) for f in fields(cls) if f.init}
    return merge_aliases(read_recipe_file(path, valid, prog), argv, path)


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> tuple[ModelArguments, DataArguments, RecipeConfig]:
    """Parse ``--config recipe.yaml`` plus command-line overrides into the three argument dataclasses.

    ``-h``/``--help`` and ``--help-all`` print the help (with the recipe's values as defaults) and exit.
    An option that is no field (``--max_stesp 5``) is a ``ValueError`` naming the closest field.
    ``prog``: the command's name in messages. Settings that the chosen weight source never reads,
    given in the recipe or on the command line, get one warning line on stderr (:func:`unread_settings`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # the recipe and the help flags first (recipes.first_pass, as before torch); a malformed argv
    # (`--config` without its value) is left to the full parse, which says what is wrong
    known = first_pass(argv) or argparse.Namespace(config=None, help=False, help_all=False)
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
