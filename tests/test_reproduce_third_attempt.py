"""The third LongPPL attempt (longppl_reproduce.common.two_hop, .third_attempt and the population
pipeline's extensions): the two-hop task's cases and documents against answers read back from the
text, the format-only exclusion, the cluster bootstrap over configurations, the within-level
statistics, the random-intercept model against an explicit-matrix fit, the decision rule on one
crafted record per outcome, and the whole pipeline on CPU."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import pytest
from conftest import REPO
from helpers import DATA, byte_level_bpe
from longppl_reproduce import population
from longppl_reproduce.common import lines, statistics, two_hop
from longppl_reproduce.common.config import read_population
from longppl_reproduce.common.run_folder import RunFolder
from longppl_reproduce.population import analysis as population_analysis
from longppl_reproduce.population import models as population_models
from longppl_reproduce.population import third_attempt

SMOKE3 = os.path.join(REPO, "configs", "reproduce", "population3_smoke_cpu.yaml")
PLAN3 = os.path.join(REPO, "configs", "reproduce", "population3_h100x4.yaml")

_NUMBER_LINE = re.compile(r"line (\S+): REGISTER_CONTENT is <(\d+)>\n")
_POINTER_LINE = re.compile(r"line (\S+): REGISTER_CONTENT is in line (\S+)\n")
_QUESTION = re.compile(r"Tell me what is the <REGISTER_CONTENT> in line (\S+)\? I need the number\.")


def read_record(text: str) -> tuple[dict, dict]:
    """``({line: number}, {line: line it names})`` read back from a record's text."""
    return dict(_NUMBER_LINE.findall(text)), dict(_POINTER_LINE.findall(text))


# ------------------------------------------------------------------ the two-hop task


def test_a_two_hop_case_asks_a_pointer_and_expects_the_named_lines_number():
    ids, numbers = ["swift-harbor", "quiet-lake", "bold-river"], ["11111", "22222", "33333"]
    case = two_hop.two_hop_case(ids, numbers, [None, None, 0], 2)
    assert "line bold-river: REGISTER_CONTENT is in line swift-harbor\n" in case.prompt
    assert case.prompt.endswith("Tell me what is the <REGISTER_CONTENT> in line bold-river? I need the number.")
    assert case.expected_number == "11111"
    assert case.answer == "The <REGISTER_CONTENT> in line bold-river is in line swift-harbor: <11111>."
    # scored by LongChat's rule: the reference answer is right, a one-hop answer (a number line's) wrong
    scored = lines.scored_answers(
        [case.answer, "The <REGISTER_CONTENT> in line quiet-lake is <22222>.", ""], ["11111"] * 3
    )
    assert scored["is_correct"] == [True, False, False]
    with pytest.raises(ValueError, match="holds a number, not a pointer"):
        two_hop.two_hop_case(ids, numbers, [None, None, 0], 1)


def test_pointers_name_earlier_number_lines_and_every_record_has_one():
    rng = np.random.default_rng(3)
    for n in (2, 3, 10, 60):
        targets = two_hop.draw_pointers(rng, n, 0.25)
        assert targets[0] is None and any(t is not None for t in targets)
        for i, t in enumerate(targets):
            assert t is None or (t < i and targets[t] is None)


def test_two_hop_cases_put_both_hops_beyond_k_and_expect_the_named_number():
    tokenizer = byte_level_bpe()
    length, beyond = 1400, 300
    cases = two_hop.two_hop_cases_beyond(tokenizer, length, 6, beyond, seed=5)
    assert cases == two_hop.two_hop_cases_beyond(tokenizer, length, 6, beyond, seed=5)
    for case in cases:
        numbers, pointers = read_record(case.prompt)
        asked = _QUESTION.search(case.prompt).group(1)
        named = pointers[asked]
        assert case.expected_number == numbers[named]
        encoded = tokenizer(case.prompt, add_special_tokens=True, return_offsets_mapping=True)
        size = len(encoded["input_ids"])
        assert size <= length
        # the last character of each hop, found in the text, lies in a token more than `beyond` back
        pointer_end = case.prompt.index(f"line {asked}: REGISTER_CONTENT is in line {named}\n") + len(
            f"line {asked}: REGISTER_CONTENT is in line {named}"
        )
        number_end = case.prompt.index(f"line {named}: REGISTER_CONTENT is <{numbers[named]}>") + len(
            f"line {named}: REGISTER_CONTENT is <{numbers[named]}"
        )
        for end in (pointer_end, number_end):
            token = next(i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a <= end - 1 < b)
            assert token < size - beyond
    with pytest.raises(ValueError, match="leaves no pointer line"):
        two_hop.two_hop_cases_beyond(tokenizer, 120, 1, 100, seed=0)


def test_two_hop_training_documents_fit_and_answer_every_question_right():
    tokenizer = byte_level_bpe()
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = two_hop.fitted_two_hop_document(tokenizer, rng, 600, min_lines=2, max_lines=30)
        assert len(ids) <= 600
        text = tokenizer.decode(ids, skip_special_tokens=True)
        numbers, pointers = read_record(text)
        answers = re.findall(r"in line (\S+) is in line (\S+): <(\d+)>\.", text)
        assert answers
        for asked, named, number in answers:
            assert pointers[asked] == named and numbers[named] == number
        assert text.rstrip().endswith(">.")  # nothing cut: the document ends with a whole answer
    with pytest.raises(ValueError, match="seq_len=60 tokens cannot hold two lines"):
        two_hop.fitted_two_hop_document(tokenizer, rng, 60, min_lines=2, max_lines=30)


# ------------------------------------------------------------------ exclusion, clusters, levels


def _record(outputs: list[str]) -> dict:
    return {"lines": {"768": {"outputs": outputs[:2]}, "984": {"outputs": outputs[2:]}}}


def test_only_the_answer_format_excludes_and_a_control_is_reported_not_analysed():
    config = read_population(PLAN3, corpus="x")
    share = population_analysis.no_answer_shape_share(_record(["<12345>.", "line 1234", "123456", "no number"]))
    assert share == 0.75  # 1234 and 123456 are not of the answer's shape
    kept = {"member": "a", "acc512": 0.0, "no_answer_shape_share": 0.5, "control": False}
    assert third_attempt.exclusion(kept, config.analysis) is None  # accuracy at 512 is no rule now
    lost = {**kept, "no_answer_shape_share": 0.6}
    assert "60% of its lines outputs hold no five-digit number" in third_attempt.exclusion(lost, config.analysis)
    assert third_attempt.exclusion({**kept, "control": True}, config.analysis).startswith("control")


def plain_spearman(x, y) -> float:
    def ranks(v):
        return [1 + sum(w < a for w in v) + (sum(w == a for w in v) - 1) / 2 for a in v]

    rx, ry = ranks(list(x)), ranks(list(y))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return sxy / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def crafted_rows(seed: int = 0, slope: float = -1.0) -> list[dict]:
    """16 configurations in 4 methods, 5 members each (steps 0, 300 x2, 1000 x2)."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(16):
        method, shift = ["yarn", "ntk", "abf", "eabf"][c // 4], rng.normal()
        for k, steps in enumerate((0, 300, 300, 1000, 1000)):
            quality = shift + 0.3 * k + rng.normal()
            rows.append(
                {
                    "member": f"c{c}-{k}",
                    "method": method,
                    "configuration": f"c{c}",
                    "control": False,
                    "steps": steps,
                    "acc512": float(rng.uniform(0.5, 1)),
                    "no_answer_shape_share": 0.0,
                    "primary_accuracy": float(quality + rng.normal()),
                    "needle": float(quality + rng.normal()),
                    "two_hop": float(quality + rng.normal()),
                    "longppl": float(math.exp(slope * quality + 0.3 * rng.normal())),
                    "longppl:E1b": float(math.exp(slope * quality + 0.3 * rng.normal())),
                    "longppl:E2": float(math.exp(slope * quality + 0.3 * rng.normal())),
                    "ppl": float(math.exp(-0.2 * k + rng.normal())),
                }
            )
    return rows


def test_the_cluster_bootstrap_resamples_configurations_not_methods():
    config = read_population(PLAN3, corpus="x")
    analysis = config.analysis.__class__(**{**config.analysis.__dict__, "resamples": 300, "mixed_model_resamples": 5})
    rows = crafted_rows()
    found = third_attempt.analyse(config.__class__(**{**config.__dict__, "analysis": analysis}), rows)
    overall = found["statistics"]["E1"]["overall"]
    assert found["clusters"] == overall["clusters"] == 16
    x, y = [r["longppl"] for r in rows], [r["composite"] for r in rows]
    by_configuration = statistics.bootstrap_correlation(
        x, y, "spearman", resamples=300, seed=0, level=0.95, clusters=[r["configuration"] for r in rows]
    )
    by_method = statistics.bootstrap_correlation(
        x, y, "spearman", resamples=300, seed=0, level=0.95, clusters=[r["method"] for r in rows]
    )
    assert overall["spearman"]["longppl"] == by_configuration
    assert overall["spearman"]["longppl"]["low"] != by_method["low"]


def test_within_level_statistics_use_only_that_levels_members_and_the_composite_is_standardised():
    config = read_population(PLAN3, corpus="x")
    analysis = config.analysis.__class__(**{**config.analysis.__dict__, "resamples": 100, "mixed_model_resamples": 5})
    rows = crafted_rows(seed=1)
    found = third_attempt.analyse(config.__class__(**{**config.__dict__, "analysis": analysis}), rows)
    parts = ("primary_accuracy", "needle", "two_hop")
    for r in rows:  # the composite, typed out: mean of z-scores over the analysed members (sd with n - 1)
        z = [(r[p] - np.mean([s[p] for s in rows])) / np.std([s[p] for s in rows], ddof=1) for p in parts]
        assert r["composite"] == pytest.approx(sum(z) / 3)
    for steps in (0, 300, 1000):
        level = [r for r in rows if r["steps"] == steps]
        got = found["statistics"]["E2"]["by_steps"][str(steps)]
        assert got["n"] == len(level) == (16 if steps == 0 else 32)
        assert got["spearman"]["longppl"]["value"] == pytest.approx(
            plain_spearman([r["longppl:E2"] for r in level], [r["composite"] for r in level])
        )
        assert got["spearman"]["ppl"]["value"] == pytest.approx(
            plain_spearman([r["ppl"] for r in level], [r["composite"] for r in level])
        )
    w = found["statistics"]["E1"]["overall"]["williams_t_ranks"]
    r_ay = plain_spearman([r["longppl"] for r in rows], [r["composite"] for r in rows])
    r_by = plain_spearman([r["ppl"] for r in rows], [r["composite"] for r in rows])
    r_ab = plain_spearman([r["longppl"] for r in rows], [r["ppl"] for r in rows])
    assert w["t"] == pytest.approx(statistics.williams_t(r_ay, r_by, r_ab, len(rows))["t"])


def test_the_random_intercept_fit_is_the_likelihood_maximum_of_explicit_matrices():
    rng = np.random.default_rng(2)
    groups = np.repeat(np.arange(8), 4)
    x, z = rng.normal(size=32), rng.normal(size=32)
    y = 1.0 - 0.7 * x + 0.2 * z + rng.normal(size=8)[groups] + 0.5 * rng.normal(size=32)
    design = np.column_stack([np.ones(32), x, z])
    best = None
    for lam in np.concatenate([[0.0], np.logspace(-3, 3, 61)]):
        v = np.eye(32) + lam * (groups[:, None] == groups[None, :])
        vi = np.linalg.inv(v)
        beta = np.linalg.solve(design.T @ vi @ design, design.T @ vi @ y)
        r = y - design @ beta
        sigma2 = r @ vi @ r / 32
        loglik = -16 * math.log(sigma2) - 0.5 * np.linalg.slogdet(v)[1]
        if best is None or loglik > best[0]:
            best = (loglik, beta, lam)
    fit = statistics.random_intercept_fit(y, x, [f"g{g}" for g in groups], covariates=z)
    assert fit["lambda"] == pytest.approx(best[2]) and fit["slope"] == pytest.approx(best[1][1])
    assert fit["coefficients"] == pytest.approx(list(best[1])) and fit["clusters"] == 8
    boot = statistics.bootstrap_random_intercept_slope(y, x, groups, covariates=z, resamples=50, seed=1)
    assert boot["low"] <= fit["slope"] <= boot["high"] and boot["resamples"] == 50


# ------------------------------------------------------------------ the decision rule


def _overall(rho, low, high, d, d_low, d_high, n=80):
    return {
        "n": n,
        "spearman": {
            "longppl": {"value": rho, "low": low, "high": high},
            "difference": {"value": d, "low": d_low, "high": d_high},
        },
    }


@pytest.mark.parametrize(
    "primary, others, outcome",
    [
        # LongPPL's upper bound below -0.3, the difference below 0, the others in the same direction
        (_overall(-0.6, -0.8, -0.4, -0.3, -0.5, -0.1), [(-0.5, -0.2), (-0.4, -0.1)], "positive"),
        # the same under E1, but E2 points the other way: not positive; no negative rule holds
        (_overall(-0.6, -0.8, -0.4, -0.3, -0.5, -0.1), [(-0.5, -0.2), (-0.4, 0.05)], "inconclusive"),
        # LongPPL's interval excludes -0.5
        (_overall(-0.2, -0.45, 0.1, -0.1, -0.4, 0.2), [(-0.1, 0.0), (-0.2, 0.1)], "negative"),
        # the difference lies within +-0.15 although LongPPL correlates strongly
        (_overall(-0.7, -0.85, -0.5, -0.02, -0.12, 0.1), [(-0.6, 0.0), (-0.6, 0.0)], "negative"),
        # both rules' first conditions hold ([-0.45, -0.35] is below -0.3 and above -0.5): positive first
        (_overall(-0.4, -0.45, -0.35, -0.2, -0.3, -0.05), [(-0.4, -0.1), (-0.4, -0.1)], "positive"),
        # wide intervals: neither
        (_overall(-0.4, -0.7, 0.0, -0.2, -0.5, 0.1), [(-0.4, -0.2), (-0.4, -0.2)], "inconclusive"),
    ],
)
def test_the_decision_rule_gives_each_outcome(primary, others, outcome):
    config = read_population(PLAN3, corpus="x")
    by = {"E1": primary}
    for name, (rho, d) in zip(("E1b", "E2"), others):
        by[name] = _overall(rho, rho - 0.2, rho + 0.2, d, d - 0.2, d + 0.2)
    decided = third_attempt.decide(by, "E1", config.analysis, min_members=48)
    assert decided["outcome"] == outcome
    assert {c["rule"] for c in decided["conditions"]} == {"positive", "negative"}
    few = third_attempt.decide({**by, "E1": {**primary, "n": 40}}, "E1", config.analysis, min_members=48)
    assert few["outcome"] == "inconclusive" and "40 members analysed" in few["reasons"][0]


# ------------------------------------------------------------------ config, shards, claims


def test_the_plans_config_holds_16_configurations_of_five_members_and_a_control():
    config = read_population(PLAN3, corpus="x")
    members = config.members()
    analysed = [m for m in members if not m.extension.control]
    assert len(members) == 85 and len(analysed) == 80
    assert len({m.configuration for m in analysed}) == 16
    assert len({m.seed for m in members}) == 85 and len({m.name for m in members}) == 85
    assert [e.name for e in config.evaluators if e.enabled] == ["E1", "E1b", "E2"]
    assert {(m.steps, m.replicate) for m in members if m.configuration == "yarn2"} == {
        (0, 1),
        (300, 1),
        (300, 2),
        (1000, 1),
        (1000, 2),
    }
    assert config.analysis.cluster == "configuration" and config.analysis.exclusion == "format"


def test_shards_interleave_and_a_claim_goes_to_one_process(tmp_path):
    config = read_population(PLAN3, corpus="x")
    names = [m.name for m in config.members()]
    shards = [[m.name for m in population_models.selected_members(config, None, (i, 4))] for i in range(4)]
    assert sorted(sum(shards, [])) == sorted(names) and shards[1] == names[1::4]
    assert population_models.selected_members(config, [], None) == []
    run = RunFolder(str(tmp_path), log=lambda *_: None)
    assert not population_models.claimed(run, "call-1", "members", "yarn2-s0")  # taken now
    assert population_models.claimed(run, "call-1", "members", "yarn2-s0")  # by another process of the call
    assert not population_models.claimed(run, "call-2", "members", "yarn2-s0")  # a later call takes it again
    assert not population_models.claimed(run, None, "members", "yarn2-s0")
    ordered = population_models.claim_order(config.members())
    assert [m.replicate for m in ordered] == sorted(m.replicate for m in ordered)


# ------------------------------------------------------------------ the whole pipeline on CPU


def test_the_third_attempts_smoke_run_writes_every_record_and_the_decision(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    argv = ["--config", SMOKE3, "--corpus", DATA, "--output-dir", str(out)]
    results = population.main(argv)
    config = read_population(SMOKE3, corpus=DATA)
    names = [m.name for m in config.members()]
    for artefact in ("eval/calibration.json", "eval/calibration-E1b.json", "eval/calibration-E2.json"):
        assert (out / artefact).is_file(), artefact
    for name in ("B", "E1", "E1b", "E2"):
        assert (out / "eval" / "gates" / f"{name}.json").is_file()
    on_disk = json.loads((out / "results.json").read_text())
    assert [r["member"] for r in on_disk["members"]] == names and on_disk["not_evaluated"] == []
    for row in on_disk["members"]:
        assert row["excluded"] == row["control"]  # the smoke keeps every non-control member
        assert 0 <= row["two_hop"] <= 1 and math.isfinite(row["longppl:E1b"]) and math.isfinite(row["longppl:E2"])
    record = json.loads((out / "eval" / "members" / f"{names[0]}.json").read_text())
    assert record["two_hop"]["total"] == config.evaluation.cases
    assert record["longppl"]["primary:E2"]["alpha"] == on_disk["calibration"]["E2"]["alpha"]
    found = on_disk["analysis"]
    assert found["clusters"] == 3 and found["analysed"] == 9
    assert set(found["statistics"]) == {"E1", "E1b", "E2"}
    assert set(found["statistics"]["E1"]["by_steps"]) == {"0", "1"}
    assert found["decision"]["outcome"] in {"positive", "negative", "inconclusive"}
    report = (out / "report.md").read_text()
    assert f"Decision by the analysis plan: **{found['decision']['outcome']}**" in report
    assert results["analysis"]["decision"] == found["decision"]
    # the report again from the records alone (what the device brings back), without the models
    records = tmp_path / "records"
    shutil.copytree(out / "eval", records / "eval")
    shutil.copy(out / "timings.json", records / "timings.json")
    again = population.main(["--config", SMOKE3, "--corpus", DATA, "--output-dir", str(records), "--stages", "report"])
    assert again["analysis"]["decision"] == found["decision"]
    assert again["members"][0]["composite"] == pytest.approx(results["members"][0]["composite"])
    overall = found["statistics"]["E1"]["overall"]["spearman"]["longppl"]
    assert again["analysis"]["statistics"]["E1"]["overall"]["spearman"]["longppl"]["low"] == pytest.approx(
        overall["low"]
    )
