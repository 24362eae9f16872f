"""longppl_reproduce.common.statistics against plain references written here (explicit sums, formulas typed
out from the textbooks, numerical integration)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from longppl_reproduce.common import statistics
from longppl_reproduce.common.statistics import (
    bootstrap_correlation,
    bootstrap_mean,
    bootstrap_partial_correlation,
    correlation,
    fisher_interval,
    normal_quantile,
    paired_bootstrap_difference,
    paired_t_interval,
    partial_correlation,
    student_t_cdf,
    student_t_quantile,
    williams_t,
    wilson_interval,
)
from scipy import optimize


def plain_pearson(x, y) -> float:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy)


def plain_ranks(values) -> list[float]:
    """Average ranks by counting: rank = 1 + (number smaller) + (number of other equal ones) / 2."""
    return [1 + sum(w < v for w in values) + (sum(w == v for w in values) - 1) / 2 for v in values]


def data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    y = 0.6 * x + rng.normal(size=n)
    z = 0.5 * x + 0.5 * y + rng.normal(size=n)
    return x.tolist(), y.tolist(), z.tolist()


def test_correlation_methods_match_explicit_sums():
    x, y, _ = data()
    assert math.isclose(correlation(x, y, "pearson"), plain_pearson(x, y), rel_tol=1e-12)
    ties = [1, 2, 2, 3, 5, 5, 5, 0, 9, 4, 4, 1]
    assert math.isclose(correlation(ties, y, "spearman"), plain_pearson(plain_ranks(ties), plain_ranks(y)))
    with pytest.raises(ValueError, match="method='kendall' is not a correlation method"):
        correlation(x, y, "kendall")


def test_bootstrap_correlation_repeats_contains_the_value_and_counts_resamples():
    x, y, _ = data(15)
    result = bootstrap_correlation(x, y, resamples=500, seed=3)
    assert result == bootstrap_correlation(x, y, resamples=500, seed=3)
    assert result != bootstrap_correlation(x, y, resamples=500, seed=4)
    assert math.isclose(result["value"], plain_pearson(x, y))
    assert result["low"] <= result["value"] <= result["high"]
    assert result["resamples"] + result["dropped"] == 500 and result["level"] == 0.95
    spearman = bootstrap_correlation(x, y, method="spearman", resamples=200, seed=3)
    assert math.isclose(spearman["value"], plain_pearson(plain_ranks(x), plain_ranks(y)))


def test_bootstrap_correlation_is_the_percentile_interval_of_resampled_items():
    """Reference: the same random draws (numpy's default_rng(seed).integers(n, size=(R, n))), the
    correlation of each resample by explicit sums, then the percentiles of the defined ones."""
    x = [1.0, 1.0, 1.0, 4.0, 3.0]  # resamples of the first three items only have no variance in x
    y = [2.0, 1.0, 3.0, 3.0, 6.0]
    R = 300
    draws = np.random.default_rng(7).integers(5, size=(R, 5))
    values = []
    for row in draws:
        xs, ys = [x[i] for i in row], [y[i] for i in row]
        if len(set(xs)) > 1 and len(set(ys)) > 1:
            values.append(plain_pearson(xs, ys))
    result = bootstrap_correlation(x, y, resamples=R, seed=7, level=0.9)
    assert result["resamples"] == len(values) and result["dropped"] == R - len(values) > 0
    low, high = np.quantile(values, [0.05, 0.95])
    assert math.isclose(result["low"], low, rel_tol=1e-9) and math.isclose(result["high"], high, rel_tol=1e-9)


def test_cluster_bootstrap_of_singletons_is_the_item_bootstrap_and_clusters_move_together():
    x, y, _ = data(10)
    items = bootstrap_correlation(x, y, resamples=300, seed=1)
    assert bootstrap_correlation(x, y, resamples=300, seed=1, clusters=[f"m{i}" for i in range(10)]) == items
    # Two clusters whose items are identical copies: a cluster resample holds each item 0, 1 or 2 times
    # with its copy, so the result equals the item bootstrap of the 5 distinct items with both drawn...
    labels = ["a", "b", "c", "d", "e"] * 2
    doubled_x, doubled_y = x[:5] * 2, y[:5] * 2
    clustered = bootstrap_correlation(doubled_x, doubled_y, resamples=300, seed=1, clusters=labels)
    # ... which is the bootstrap of the 5 items (duplicating every item leaves Pearson's r unchanged).
    items_of_five = bootstrap_correlation(x[:5], y[:5], resamples=300, seed=1)
    assert clustered == pytest.approx(items_of_five, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="clusters has 3 labels for 10 items"):
        bootstrap_correlation(x, y, resamples=10, clusters=["a", "b", "c"])


def test_bootstrap_inputs_are_checked():
    with pytest.raises(ValueError, match=r"shapes x \(3,\), y \(2,\)"):
        bootstrap_correlation([1, 2, 3], [1, 2], resamples=10)
    with pytest.raises(ValueError, match="level=1.5 is not a confidence level"):
        bootstrap_correlation([1, 2, 3], [1, 2, 4], resamples=10, level=1.5)
    with pytest.raises(ValueError, match="resamples must be an integer >= 1, got 0"):
        bootstrap_correlation([1, 2, 3], [1, 2, 4], resamples=0)


def test_paired_bootstrap_difference_uses_the_same_items_for_both_correlations():
    a, y, b = data(14, seed=5)
    R = 400
    draws = np.random.default_rng(2).integers(14, size=(R, 14))
    differences = []
    for row in draws:
        ys = [y[i] for i in row]
        differences.append(plain_pearson([a[i] for i in row], ys) - plain_pearson([b[i] for i in row], ys))
    result = paired_bootstrap_difference(a, b, y, resamples=R, seed=2)
    value = plain_pearson(a, y) - plain_pearson(b, y)
    assert math.isclose(result["value"], value)
    low, high = np.quantile(differences, [0.025, 0.975])
    assert math.isclose(result["low"], low, rel_tol=1e-9) and math.isclose(result["high"], high, rel_tol=1e-9)
    other_side = sum(d <= 0 for d in differences) if value > 0 else sum(d >= 0 for d in differences)
    assert math.isclose(result["p_two_sided"], min(1.0, 2 * other_side / R))
    assert result["resamples"] == R and result["level"] == 0.95
    same = paired_bootstrap_difference(a, a, y, resamples=50, seed=2)
    assert same["value"] == 0 and same["p_two_sided"] == 1.0 and same["low"] == same["high"] == 0


def t_density(x, df):
    return math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)) * (
        1 + x * x / df
    ) ** (-(df + 1) / 2)


def integrated_t_cdf(t, df, steps=200000):
    """P(T <= t) = 1/2 + integral of the density from 0 to t (Simpson's rule)."""
    h = t / steps
    total = t_density(0, df) + t_density(t, df)
    total += sum((4 if k % 2 else 2) * t_density(k * h, df) for k in range(1, steps))
    return 0.5 + total * h / 3


@pytest.mark.parametrize("t, df", [(0.3, 1), (-1.7, 2), (2.1, 5), (-3.5, 9), (1.0, 30), (4.2, 17)])
def test_student_t_cdf_matches_numerical_integration(t, df):
    assert math.isclose(student_t_cdf(t, df), integrated_t_cdf(t, df), rel_tol=1e-8, abs_tol=1e-10)


def test_williams_t_matches_the_formula_typed_out():
    """Steiger (1980), eq. 7, written out with the determinant of the 3x3 correlation matrix."""
    r_ay, r_by, r_ab, n = 0.62, 0.35, 0.48, 25
    R = np.array([[1, r_ab, r_ay], [r_ab, 1, r_by], [r_ay, r_by, 1]])
    det = float(np.linalg.det(R))
    r_bar = (r_ay + r_by) / 2
    t = (r_ay - r_by) * math.sqrt((n - 1) * (1 + r_ab) / (2 * (n - 1) / (n - 3) * det + r_bar**2 * (1 - r_ab) ** 3))
    result = williams_t(r_ay, r_by, r_ab, n)
    assert math.isclose(result["t"], t, rel_tol=1e-12) and result["df"] == n - 3
    assert math.isclose(result["p_two_sided"], 2 * (1 - integrated_t_cdf(abs(t), n - 3)), rel_tol=1e-7)
    assert williams_t(r_by, r_ay, r_ab, n)["t"] == pytest.approx(-t)
    with pytest.raises(ValueError, match="n must be an integer >= 4, got 3"):
        williams_t(0.5, 0.4, 0.3, 3)
    with pytest.raises(ValueError, match="r_ab=1.2 is not a correlation"):
        williams_t(0.5, 0.4, 1.2, 10)


def test_partial_correlation_matches_the_recursive_formula():
    x, y, z = data(20, seed=9)
    rxy, rxz, ryz = plain_pearson(x, y), plain_pearson(x, z), plain_pearson(y, z)
    expected = (rxy - rxz * ryz) / math.sqrt((1 - rxz**2) * (1 - ryz**2))
    assert math.isclose(partial_correlation(x, y, z), expected, rel_tol=1e-10)
    result = bootstrap_partial_correlation(x, y, z, resamples=200, seed=0)
    assert math.isclose(result["value"], expected, rel_tol=1e-10)
    assert result["low"] <= result["value"] <= result["high"] and result["resamples"] == 200
    assert result == bootstrap_partial_correlation(x, y, z, resamples=200, seed=0)
    with pytest.raises(ValueError, match=r"z has shape \(3,\)"):
        partial_correlation(x, y, z[:3])


def test_fisher_and_wilson_intervals_match_closed_forms():
    q = 1.959963984540054  # the 0.975 normal quantile
    assert math.isclose(normal_quantile(0.975), q, rel_tol=1e-12)
    r, n = 0.55, 30
    zr = 0.5 * math.log((1 + r) / (1 - r))
    low, high = fisher_interval(r, n)
    assert math.isclose(low, math.tanh(zr - q / math.sqrt(n - 3)))
    assert math.isclose(high, math.tanh(zr + q / math.sqrt(n - 3)))
    for successes, trials in ((0, 10), (7, 20), (20, 20), (130, 400)):
        p = successes / trials
        root = q * math.sqrt(p * (1 - p) / trials + q * q / (4 * trials * trials))
        expected = (
            (p + q * q / (2 * trials) - root) / (1 + q * q / trials),
            (p + q * q / (2 * trials) + root) / (1 + q * q / trials),
        )
        got = wilson_interval(successes, trials)
        assert got == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="successes=11 is more than n=10"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="r=1.0: Fisher's interval"):
        fisher_interval(1.0, 10)


def test_bootstrap_mean_is_the_percentile_interval_of_resampled_means():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    draws = np.random.default_rng(4).integers(8, size=(250, 8))
    means = [sum(values[i] for i in row) / 8 for row in draws]
    result = bootstrap_mean(values, resamples=250, seed=4, level=0.8)
    assert math.isclose(result["value"], sum(values) / 8)
    low, high = np.quantile(means, [0.1, 0.9])
    assert math.isclose(result["low"], low) and math.isclose(result["high"], high)
    assert result["resamples"] == 250


@pytest.mark.parametrize("r_ab", [1.0, -1.0])
def test_williams_t_refuses_perfectly_correlated_predictors(r_ab):
    with pytest.raises(ValueError, match=r"r_ab=.*perfectly correlated, so Williams' t is undefined"):
        williams_t(-0.6, -0.6 * r_ab, r_ab, 20)


# Two-sided 95% critical values of Student's t from the printed tables (e.g. Fisher and Yates).
T_975 = {1: 12.706205, 2: 4.302653, 4: 2.776445, 9: 2.262157, 29: 2.045230}


@pytest.mark.parametrize("df", sorted(T_975))
def test_student_t_quantile_matches_the_tables_and_inverts_the_integrated_cdf(df):
    q = student_t_quantile(0.975, df)
    assert math.isclose(q, T_975[df], abs_tol=2e-6)
    assert math.isclose(integrated_t_cdf(q, df, steps=20000), 0.975, abs_tol=1e-9)
    assert math.isclose(student_t_quantile(0.025, df), -q, rel_tol=1e-9)


def test_paired_t_interval_matches_the_textbook_interval_typed_out():
    ce = [0.41, 0.38, 0.45, 0.40, 0.36]
    longce = [0.47, 0.40, 0.52, 0.49, 0.37]
    d = [x - y for x, y in zip(longce, ce)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
    half = T_975[n - 1] * sd / math.sqrt(n)
    found = paired_t_interval(longce, ce)
    assert math.isclose(found["value"], mean, rel_tol=1e-12)
    assert math.isclose(found["sd"], sd, rel_tol=1e-12)
    assert math.isclose(found["low"], mean - half, abs_tol=1e-6)
    assert math.isclose(found["high"], mean + half, abs_tol=1e-6)
    t = mean / (sd / math.sqrt(n))
    assert math.isclose(found["t"], t, rel_tol=1e-12) and found["df"] == n - 1
    assert math.isclose(found["p_two_sided"], 2 * integrated_t_cdf(-abs(t), n - 1, steps=20000), abs_tol=1e-9)
    # the order of the arms flips the sign, not the width
    flipped = paired_t_interval(ce, longce)
    assert math.isclose(flipped["low"], -found["high"], abs_tol=1e-12)


def test_paired_t_interval_of_equal_differences_and_bad_inputs():
    found = paired_t_interval([3.0, 4.0, 5.0], [1.0, 2.0, 3.0])
    assert found["low"] == found["high"] == 2.0 and found["p_two_sided"] == 0.0
    with pytest.raises(ValueError, match="got 1 pair.*at least 2"):
        paired_t_interval([0.5], [0.4])
    with pytest.raises(ValueError, match="one length"):
        paired_t_interval([0.5, 0.6], [0.4])
    with pytest.raises(ValueError, match="p=1.5 is not a probability"):
        student_t_quantile(1.5, 3)


# ------------------------------------------------------------------ pooled means over starting points


def test_the_random_intercept_mean_is_the_gls_mean_of_explicit_matrices_with_a_conservative_t():
    rng = np.random.default_rng(5)
    groups = np.repeat(np.arange(3), 4)
    y = 0.05 + np.array([0.04, -0.03, 0.01])[groups] + 0.01 * rng.normal(size=12)
    found = statistics.random_intercept_mean(y, [f"s{g}" for g in groups])

    def fit(lam):
        v = np.eye(12) + lam * (groups[:, None] == groups[None, :])
        vi = np.linalg.inv(v)
        one = np.ones(12)
        mu = (one @ vi @ y) / (one @ vi @ one)
        r = y - mu
        sigma2 = r @ vi @ r / 12
        loglik = -6 * math.log(sigma2) - 0.5 * np.linalg.slogdet(v)[1]
        return loglik, mu, lam, sigma2, math.sqrt(sigma2 / (one @ vi @ one))

    # the maximum likelihood by a general optimiser over log lambda (the boundary lambda = 0 beside it)
    optimum = optimize.minimize_scalar(
        lambda t: -fit(math.exp(t))[0], bounds=(-12, 8), method="bounded", options={"xatol": 1e-10}
    )
    best = max(fit(0.0), fit(math.exp(optimum.x)), key=lambda found: found[0])
    _, mu, lam, sigma2, se = best
    assert found["value"] == pytest.approx(mu) and found["lambda"] == pytest.approx(lam, rel=1e-5)
    assert found["se"] == pytest.approx(se, rel=1e-6) and found["df"] == 2 and found["clusters"] == 3
    q = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom
    assert found["low"] == pytest.approx(mu - q * se) and found["high"] == pytest.approx(mu + q * se)
    with pytest.raises(ValueError, match="at least 2 clusters"):
        statistics.random_intercept_mean([0.1, 0.2], ["a", "a"])


def test_the_fixed_effects_mean_weights_clusters_equally_with_the_pooled_within_variance():
    groups = ["a"] * 4 + ["b"] * 2 + ["c"] * 3
    y = np.array([1.0, 2.0, 3.0, 4.0, 10.0, 12.0, 5.0, 6.0, 7.0])
    found = statistics.fixed_effects_mean(y, groups)
    means = [2.5, 11.0, 6.0]
    within = (5.0 + 2.0 + 2.0) / (9 - 3)
    se = math.sqrt(within * (1 / 4 + 1 / 2 + 1 / 3)) / 3
    q = 2.446911851144969  # Student t, 0.975 quantile, 6 degrees of freedom
    assert found["value"] == pytest.approx(sum(means) / 3) and found["cluster_means"] == pytest.approx(means)
    assert found["se"] == pytest.approx(se) and found["df"] == 6
    assert found["low"] == pytest.approx(found["value"] - q * se)
    with pytest.raises(ValueError, match="more values"):
        statistics.fixed_effects_mean([1.0, 2.0], ["a", "b"])


def plain_holm(p_values: dict, alpha: float) -> dict:
    """Holm's procedure step by step: sort, reject while p_(i) <= alpha / (m - i) (0-based), stop at
    the first that is not; adjusted p_(i) = max over j <= i of min(1, (m - j) p_(j)), a double loop."""
    names = sorted(p_values, key=lambda n: p_values[n])
    m = len(names)
    rejected, stopped = set(), False
    for i, name in enumerate(names):
        if not stopped and p_values[name] <= alpha / (m - i):
            rejected.add(name)
        else:
            stopped = True
    adjusted = {}
    for i, name in enumerate(names):
        adjusted[name] = max(min(1.0, (m - j) * p_values[names[j]]) for j in range(i + 1))
    return {n: {"p": p_values[n], "p_holm": adjusted[n], "rejected": n in rejected} for n in p_values}


def test_holm_by_hand():
    # sorted: d 0.005, a 0.01, c 0.03, b 0.04; thresholds 0.0125, 0.0167, 0.025, 0.05
    found = statistics.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}, alpha=0.05)
    assert list(found) == ["a", "b", "c", "d"]
    assert {n: f["p_holm"] for n, f in found.items()} == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})
    # c and b are below 0.05 unadjusted; Holm stops at c (0.03 > 0.025), so b is kept though 0.04 <= 0.05
    assert {n: f["rejected"] for n, f in found.items()} == {"a": True, "b": False, "c": False, "d": True}
    assert found["b"]["p"] == 0.04
    assert statistics.holm({"x": 0.6, "y": 0.9}, alpha=0.05)["x"]["p_holm"] == 1.0  # 2 x 0.6, capped at 1


@pytest.mark.parametrize("seed", range(5))
def test_holm_equals_the_plain_step_down_procedure(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 9))
    p_values = {f"h{i}": float(v) for i, v in enumerate(rng.uniform(0, 0.08, m) ** rng.uniform(0.5, 2))}
    p_values["tie"] = p_values["h0"]  # ties are sorted in the order given, by both
    for alpha in (0.05, 0.1):
        found, expected = statistics.holm(p_values, alpha), plain_holm(p_values, alpha)
        for name in p_values:
            assert found[name]["p_holm"] == pytest.approx(expected[name]["p_holm"], abs=1e-15)
            assert found[name]["rejected"] == expected[name]["rejected"]


def test_holm_rejects_what_is_not_a_p_value():
    with pytest.raises(ValueError, match="p-value of 'a' is 1.5"):
        statistics.holm({"a": 1.5})
    with pytest.raises(ValueError, match="p-value of 'a' is nan"):
        statistics.holm({"a": float("nan")})
    with pytest.raises(ValueError, match="alpha=0 is not a test level"):
        statistics.holm({"a": 0.1}, alpha=0)
