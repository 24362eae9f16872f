"""The key-token rule travels whole: every surface builds it from all of its fields by name
(``KeyTokenRule.of``), so a field added to the rule is never silently dropped on the way, and the
rule is worded for people in one place (``KeyTokenRule.describe``, ``key_condition``)."""

import argparse
import ast
import dataclasses
import math
import os

import numpy as np
import pytest
from helpers import byte_level_bpe, govreport_texts, metaspace_bpe, tiny_model

from longppl.core.scoring import EvaluatorScores
from longppl.settings import KeyTokenRule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = tuple(f.name for f in dataclasses.fields(KeyTokenRule))
#: Functions that build a rule from thresholds of their own, not from a rule that existed before
#: them: the drop-in's public ``alpha``/``beta`` (the official signature), the calibration's alpha
#: grid, the answer-token analysis's two rules and the benchmark's formula against the reference.
OWN_THRESHOLDS = {"_checked_arguments", "key_token_count", "classify_answer_tokens", "our_longppl"}


def off_default_rule() -> KeyTokenRule:
    """A rule with every field away from its default: one a surface drops comes back changed."""
    values = {}
    for f in dataclasses.fields(KeyTokenRule):
        values[f.name] = (not f.default) if isinstance(f.default, bool) else f.default + 0.75
    return KeyTokenRule(**values)


def test_of_reads_every_field_by_name_from_a_mapping_or_an_object():
    rule = off_default_rule()
    values = dataclasses.asdict(rule)
    assert KeyTokenRule.of(values) == rule
    assert KeyTokenRule.of(argparse.Namespace(**values, output="x")) == rule  # other names ignored
    assert KeyTokenRule.of({"alpha": 1.0, "beta": None}) == KeyTokenRule(alpha=1.0)  # None: the default
    with pytest.raises(ValueError, match="alpha must be a finite number, got nan"):
        KeyTokenRule.of({"alpha": math.nan})


def test_a_field_added_to_the_rule_travels_through_of():
    """A rule with one more field (a subclass standing in for the next version of the rule) keeps it
    through ``of``: nothing there lists the fields it knows."""

    @dataclasses.dataclass(frozen=True)
    class Extended(KeyTokenRule):
        lcl_margin: float = 0.0

    rule = Extended(alpha=1.0, lcl_margin=0.5)
    assert Extended.of(dataclasses.asdict(rule)) == rule
    assert Extended.of(argparse.Namespace(**dataclasses.asdict(rule))).lcl_margin == 0.5


def _rebuilds(call: ast.Call) -> bool:
    """Whether a ``KeyTokenRule(...)`` call takes rule fields one by one from somewhere else: an
    attribute named as a field (``args.alpha``, ``o.soft``), a variable named as one (a parameter
    ``alpha``), or ``**`` of a mapping picked by a list of names."""
    for value in [*call.args, *(keyword.value for keyword in call.keywords)]:
        if isinstance(value, ast.Attribute) and value.attr in FIELDS:
            return True
        if isinstance(value, ast.Name) and value.id in FIELDS:
            return True
        if isinstance(value, ast.UnaryOp) and isinstance(value.operand, ast.Attribute) and value.operand.attr in FIELDS:
            return True
    return any(keyword.arg is None for keyword in call.keywords)


def _python_files(*folders):
    for folder in folders:
        for root, _, names in os.walk(os.path.join(REPO, folder)):
            yield from (os.path.join(root, name) for name in names if name.endswith(".py"))


def test_no_surface_rebuilds_the_rule_from_some_of_its_fields():
    """Every ``KeyTokenRule(...)`` in the library and the scripts either builds a rule from values of
    its own (the defaults, a computed threshold) or sits in a function of :data:`OWN_THRESHOLDS`;
    a rule that arrives as a mapping, options or parsed arguments is read whole with ``of``."""
    found = []

    def visit(node, path, enclosing):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            enclosing = enclosing | {node.name}
        callee = getattr(node, "func", None)
        name = getattr(callee, "attr", None) or getattr(callee, "id", None)
        if isinstance(node, ast.Call) and name == "KeyTokenRule" and _rebuilds(node):
            if not enclosing & OWN_THRESHOLDS:
                found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, path, enclosing)

    for path in _python_files("metrics/longppl", "scripts"):
        if not path.endswith(os.path.join("longppl", "settings.py")):
            visit(ast.parse(open(path, encoding="utf-8").read()), path, frozenset())
    assert not found, "KeyTokenRule rebuilt from some of its fields (use KeyTokenRule.of): " + ", ".join(found)


def test_the_metric_applies_and_reports_every_field(monkeypatch):
    """Every field is one of the metric's options, and the rule the metric reports in ``settings``
    (and applies) is the one passed, whole."""
    from longppl.metric.compute import compute_metric
    from longppl.metric.options import LongPPLOptions

    options = {f.name for f in dataclasses.fields(LongPPLOptions)}
    assert set(FIELDS) <= options, f"rule fields the metric does not take: {set(FIELDS) - options}"
    ev_tok, tok = byte_level_bpe(), metaspace_bpe()
    rule = dataclasses.replace(off_default_rule(), alpha=0.005, beta=-50.0)
    result = compute_metric(
        [govreport_texts()[0][:700]],
        model=tiny_model("qwen2", len(tok), seed=2),
        tokenizer=tok,
        evaluator_model=tiny_model("llama", len(ev_tok), seed=1),
        evaluator_tokenizer=ev_tok,
        trunc_len=32,
        sliding_window=16,
        progress=False,
        **dataclasses.asdict(rule),
    )
    assert KeyTokenRule.of(result["settings"]) == rule


def test_the_harness_takes_every_field_as_a_setting():
    task = pytest.importorskip("longppl.harness.task", exc_type=ImportError)
    assert set(FIELDS) <= set(task.SETTINGS)


def test_the_commands_read_the_rule_whole():
    from longppl.tools import cache_tool, evaluate_models

    parser = evaluate_models.build_parser()
    args = parser.parse_args(
        ["--key-tokens", "k", "--models", "m", "--alpha", "1.5", "--beta", "-3", "--no-lcl", "--soft", "--gamma", "2"]
    )
    assert KeyTokenRule.of(args) == KeyTokenRule(1.5, -3.0, use_lcl=False, soft=True, gamma=2.0)
    args = cache_tool.build_parser().parse_args(["curate", "c", "--alpha", "1.5", "--beta", "-3"])
    assert KeyTokenRule.of(args) == KeyTokenRule(1.5, -3.0)


def test_the_rule_is_worded_in_one_place():
    assert KeyTokenRule().describe() == "LSD > 2 and LCL > -2"
    assert KeyTokenRule(alpha=1.5, use_lcl=False).describe() == "LSD > 1.5"
    assert KeyTokenRule(soft=True, gamma=3.0).describe() == "weights min(exp(LSD), 3)"
    assert KeyTokenRule(soft=True).key_condition("&gt;") == "LSD &gt; 2 and LCL &gt; -2"


def test_the_page_takes_the_rule_whole_or_by_its_values():
    from longppl.views.key_token_html import key_token_html

    text = "abcdef"
    offsets = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6]])
    lp_long = np.array([np.nan, -1.0, -1.0, -3.0, -0.5, -1.0], dtype=np.float32)
    lp_short = np.array([np.nan, np.nan, -4.0, -6.0, -1.0, -4.0], dtype=np.float32)
    scores = EvaluatorScores(np.arange(6), offsets, lp_long, lp_short)
    rule = KeyTokenRule(alpha=2.0, beta=-2.0, use_lcl=False)
    whole = key_token_html(text, scores, trunc_len=2, rule=rule)
    assert whole == key_token_html(text, scores, 2.0, -2.0, False, trunc_len=2)
    assert "key iff LSD &gt; 2," in whole and 'data-count="key">3<' in whole  # tokens 2, 3, 5: no LCL test
    with pytest.raises(ValueError, match="Got both a KeyTokenRule and alpha"):
        key_token_html(text, scores, 2.0, trunc_len=2, rule=rule)
