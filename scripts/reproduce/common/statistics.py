"""Statistics of the reproduction: correlations with bootstrap intervals, the test of a
LongPPL-minus-PPL difference of correlations, partial correlation, and intervals for proportions.

Plain numpy and the standard library (no scipy). Every array argument is a ``[n]`` sequence of one
value per item (a model, a document); ``clusters`` (optional, ``[n]``) gives each item a label
(e.g. the model's context-extension method), and the bootstraps then resample whole clusters with
replacement instead of items, so that items sharing a label are never treated as independent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from statistics import NormalDist

import numpy as np

from longppl.commandline.correlation import pearson, spearman
from longppl.settings import require_int

__all__ = [
    "bootstrap_correlation",
    "bootstrap_mean",
    "bootstrap_partial_correlation",
    "correlation",
    "fisher_interval",
    "normal_quantile",
    "paired_bootstrap_difference",
    "paired_t_interval",
    "partial_correlation",
    "fixed_effects_mean",
    "holm",
    "random_intercept_fit",
    "random_intercept_mean",
    "bootstrap_random_intercept_slope",
    "pearson",
    "spearman",
    "student_t_cdf",
    "student_t_quantile",
    "wilson_interval",
    "williams_t",
]

_METHODS = {"pearson": pearson, "spearman": spearman}


def _method(method: str) -> Callable:
    if method not in _METHODS:
        raise ValueError(f"method={method!r} is not a correlation method; use one of {sorted(_METHODS)}.")
    return _METHODS[method]


def correlation(x, y, method: str = "pearson") -> float:
    """Pearson's r or Spearman's rho of two ``[n]`` sequences; NaN when one of them is constant."""
    return _method(method)(x, y)


def normal_quantile(p: float) -> float:
    """The ``p`` quantile of the standard normal distribution, ``0 < p < 1``."""
    return NormalDist().inv_cdf(p)


def _check_level(level) -> float:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level={level!r} is not a confidence level; pass a number between 0 and 1, e.g. 0.95.")
    return float(level)


def _columns(names: Sequence[str], arrays: Sequence) -> list[np.ndarray]:
    """The arrays as float64 ``[n]``, all of one length (else ``ValueError`` naming them)."""
    columns = [np.asarray(a, dtype=np.float64) for a in arrays]
    shapes = {name: c.shape for name, c in zip(names, columns)}
    if any(c.ndim != 1 for c in columns) or len({c.shape for c in columns}) != 1:
        described = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"Need one-dimensional sequences of one length, got shapes {described}.")
    return columns


def _cluster_members(n: int, clusters) -> list[np.ndarray]:
    """Item indices of each cluster, clusters in order of first appearance; each item its own
    cluster when ``clusters`` is ``None`` (so the item bootstrap is the cluster bootstrap of
    singletons, drawing the same random numbers)."""
    if clusters is None:
        return [np.array([i]) for i in range(n)]
    labels = list(clusters)
    if len(labels) != n:
        raise ValueError(f"clusters has {len(labels)} labels for {n} items; give one label per item.")
    members: dict = {}
    for index, label in enumerate(labels):
        members.setdefault(label, []).append(index)
    return [np.array(indices) for indices in members.values()]


def _resampled_indices(n: int, clusters, resamples: int, seed: int) -> list[np.ndarray]:
    """``resamples`` index arrays: each draws as many clusters as there are, with replacement, and
    takes all their items."""
    require_int("resamples", resamples)
    members = _cluster_members(n, clusters)
    draws = np.random.default_rng(seed).integers(len(members), size=(resamples, len(members)))
    return [np.concatenate([members[c] for c in row]) for row in draws]


def percentile_summary(value: float, samples: Sequence[float], level: float) -> dict:
    """``value`` with the percentile interval of the defined (non-NaN) ``samples``."""
    samples = np.asarray(samples, dtype=np.float64)
    defined = samples[~np.isnan(samples)]
    if defined.size == 0:
        low = high = float("nan")
    else:
        low, high = (float(q) for q in np.quantile(defined, [(1 - level) / 2, (1 + level) / 2]))
    return {
        "value": float(value),
        "low": low,
        "high": high,
        "resamples": int(defined.size),
        "dropped": int(samples.size - defined.size),
        "level": level,
    }


def bootstrap_correlation(
    x, y, method: str = "pearson", resamples: int = 10000, seed: int = 0, level: float = 0.95, clusters=None
) -> dict:
    """The correlation of ``x`` and ``y`` with a percentile bootstrap interval.

    Resamples whose correlation is undefined (a side without variance) are dropped and counted.

    Returns:
        ``{"value", "low", "high", "resamples": resamples with a defined correlation,
        "dropped": the others, "level"}``.
    """
    function, level = _method(method), _check_level(level)
    x, y = _columns(("x", "y"), (x, y))
    samples = [function(x[i], y[i]) for i in _resampled_indices(x.shape[0], clusters, resamples, seed)]
    return percentile_summary(function(x, y), samples, level)


def paired_bootstrap_difference(
    a, b, y, method: str = "pearson", resamples: int = 10000, seed: int = 0, level: float = 0.95, clusters=None
) -> dict:
    """``r(a, y) - r(b, y)`` with a percentile bootstrap interval, both correlations computed on the
    SAME resampled items in every resample (the difference of dependent correlations).

    ``p_two_sided`` is twice the share of defined resamples on the other side of 0 from the
    observed difference (``<= 0`` for a positive difference, ``>= 0`` for a negative one), capped
    at 1; 1 when the observed difference is 0.

    Returns:
        ``{"value", "low", "high", "p_two_sided", "resamples", "dropped", "level"}``.
    """
    function, level = _method(method), _check_level(level)
    a, b, y = _columns(("a", "b", "y"), (a, b, y))
    samples = np.array(
        [function(a[i], y[i]) - function(b[i], y[i]) for i in _resampled_indices(y.shape[0], clusters, resamples, seed)]
    )
    result = percentile_summary(function(a, y) - function(b, y), samples, level)
    defined = samples[~np.isnan(samples)]
    value = result["value"]
    if defined.size == 0 or math.isnan(value):
        p = float("nan")
    elif value == 0:
        p = 1.0
    else:
        other_side = (defined <= 0) if value > 0 else (defined >= 0)
        p = min(1.0, 2.0 * float(other_side.mean()))
    return {**result, "p_two_sided": p}


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz), which
    converges fast for ``x < (a + 1) / (a + b + 2)``."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 10000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


def _regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)`` for ``a, b > 0`` and ``0 <= x <= 1``."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    # The symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast region.
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df > 0`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df={df!r}: Student's t needs more than 0 degrees of freedom.")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    # P(|T| > |t|) = I_{df / (df + t^2)}(df / 2, 1 / 2)
    tail = _regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail / 2.0 if t > 0 else tail / 2.0


def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df > 0`` degrees of freedom, ``0 < p < 1``: the
    root of :func:`student_t_cdf` by bisection (the cdf is monotone, so bisection cannot miss it)."""
    if not 0 < p < 1:
        raise ValueError(f"p={p!r} is not a probability strictly between 0 and 1.")
    if not df > 0:
        raise ValueError(f"df={df!r}: Student's t needs more than 0 degrees of freedom.")
    low, high = -1.0, 1.0
    while student_t_cdf(low, df) > p:
        low *= 2
    while student_t_cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if student_t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * max(1.0, abs(middle)):
            break
    return (low + high) / 2


def paired_t_interval(a, b, level: float = 0.95) -> dict:
    """The mean of the paired differences ``a[i] - b[i]`` (``[n]`` each, item ``i`` of both from the
    same unit, e.g. a seed) with its Student t interval: ``mean -+ q * sd / sqrt(n)``, ``sd`` the
    sample standard deviation of the differences, ``q`` the t quantile of ``(1 + level) / 2`` with
    ``n - 1`` degrees of freedom.

    Returns:
        ``{"value", "low", "high", "sd", "n", "df", "t", "p_two_sided", "level"}``; differences that
        are all equal give the interval ``[value, value]`` (no spread to estimate), ``t`` infinite
        (NaN when the value is 0) and ``p`` 0 (1).
    """
    level = _check_level(level)
    a, b = _columns(("a", "b"), (a, b))
    n = a.shape[0]
    if n < 2:
        raise ValueError(f"paired_t_interval got {n} pair(s); a t interval needs at least 2 (e.g. 2 seeds).")
    differences = a - b
    mean = float(differences.mean())
    sd = float(differences.std(ddof=1))
    df = n - 1
    if sd == 0:
        t = math.nan if mean == 0 else math.copysign(math.inf, mean)
        low = high = mean
        p = 1.0 if mean == 0 else 0.0
    else:
        standard_error = sd / math.sqrt(n)
        half = student_t_quantile((1 + level) / 2, df) * standard_error
        low, high, t = mean - half, mean + half, mean / standard_error
        p = min(1.0, 2.0 * student_t_cdf(-abs(t), df))
    return {
        "value": mean,
        "low": low,
        "high": high,
        "sd": sd,
        "n": n,
        "df": df,
        "t": t,
        "p_two_sided": p,
        "level": level,
    }


def williams_t(r_ay: float, r_by: float, r_ab: float, n: int) -> dict:
    """Williams' (1959) t for two dependent correlations ``r_ay`` and ``r_by`` sharing ``y``, in
    Steiger's (1980, eq. 7) form, with ``r_ab`` the correlation of ``a`` and ``b`` and ``n`` items:

    ``t = (r_ay - r_by) * sqrt((n-1)(1+r_ab) / (2 (n-1)/(n-3) |R| + rbar^2 (1-r_ab)^3))``,
    ``|R| = 1 - r_ay^2 - r_by^2 - r_ab^2 + 2 r_ay r_by r_ab``, ``rbar = (r_ay + r_by) / 2``,
    ``df = n - 3``.

    Returns:
        ``{"t", "df", "p_two_sided"}`` (p from Student's t with ``df`` degrees of freedom).
    """
    require_int("n", n, minimum=4)
    for name, r in (("r_ay", r_ay), ("r_by", r_by), ("r_ab", r_ab)):
        if not -1 <= r <= 1:
            raise ValueError(f"{name}={r!r} is not a correlation; pass a number between -1 and 1.")
    if abs(r_ab) == 1:
        # a and b are one variable up to sign and scale: r_by is +-r_ay, and the variance of the
        # difference the test divides by is 0
        raise ValueError(
            f"r_ab={r_ab!r}: a and b are perfectly correlated, so Williams' t is undefined; report the two "
            "correlations without a test."
        )
    determinant = 1 - r_ay**2 - r_by**2 - r_ab**2 + 2 * r_ay * r_by * r_ab
    mean_r = (r_ay + r_by) / 2
    denominator = 2 * (n - 1) / (n - 3) * determinant + mean_r**2 * (1 - r_ab) ** 3
    t = (r_ay - r_by) * math.sqrt((n - 1) * (1 + r_ab) / denominator)
    df = n - 3
    return {"t": t, "df": df, "p_two_sided": min(1.0, 2.0 * student_t_cdf(-abs(t), df))}


def _residuals(values: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``values`` minus their least-squares fit on ``z`` (``[n]`` or ``[n, k]``) and an intercept."""
    design = np.column_stack([np.ones(values.shape[0]), z.reshape(values.shape[0], -1)])
    coefficients, *_ = np.linalg.lstsq(design, values, rcond=None)
    return values - design @ coefficients


def _partial(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> float:
    return pearson(_residuals(x, z), _residuals(y, z))


def _partial_inputs(x, y, z) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, y = _columns(("x", "y"), (x, y))
    z = np.asarray(z, dtype=np.float64)
    if z.ndim not in (1, 2) or z.shape[0] != x.shape[0]:
        raise ValueError(f"z has shape {z.shape}; give [n] or [n, k] values for the {x.shape[0]} items.")
    return x, y, z


def partial_correlation(x, y, z) -> float:
    """Pearson's r of the residuals of ``x`` and of ``y`` after least squares on ``z`` (``[n]`` or
    ``[n, k]``, with an intercept): the correlation of ``x`` and ``y`` with ``z`` held fixed. NaN
    when a residual is constant."""
    return _partial(*_partial_inputs(x, y, z))


def bootstrap_partial_correlation(
    x, y, z, resamples: int = 10000, seed: int = 0, level: float = 0.95, clusters=None
) -> dict:
    """:func:`partial_correlation` with a percentile bootstrap interval, as
    :func:`bootstrap_correlation` (same keys; resamples with an undefined value dropped)."""
    level = _check_level(level)
    x, y, z = _partial_inputs(x, y, z)
    samples = [_partial(x[i], y[i], z[i]) for i in _resampled_indices(x.shape[0], clusters, resamples, seed)]
    return percentile_summary(_partial(x, y, z), samples, level)


def fisher_interval(r: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """Confidence interval of a Pearson correlation ``r`` of ``n > 3`` items by Fisher's z:
    ``tanh(atanh(r) -+ q / sqrt(n - 3))``, ``q`` the normal quantile of ``(1 + level) / 2``."""
    require_int("n", n, minimum=4)
    level = _check_level(level)
    if not -1 < r < 1:
        raise ValueError(f"r={r!r}: Fisher's interval needs a correlation strictly between -1 and 1.")
    half = normal_quantile((1 + level) / 2) / math.sqrt(n - 3)
    return math.tanh(math.atanh(r) - half), math.tanh(math.atanh(r) + half)


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion ``successes / n`` (e.g. an accuracy)."""
    require_int("n", n)
    require_int("successes", successes, minimum=0)
    if successes > n:
        raise ValueError(f"successes={successes} is more than n={n}; count successes among the n trials.")
    q = normal_quantile((1 + _check_level(level)) / 2)
    share = successes / n
    center = (share + q * q / (2 * n)) / (1 + q * q / n)
    half = q / (1 + q * q / n) * math.sqrt(share * (1 - share) / n + q * q / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def bootstrap_mean(values, resamples: int = 10000, seed: int = 0, level: float = 0.95) -> dict:
    """The mean of ``[n]`` values (e.g. one per document) with a percentile bootstrap interval.

    Returns:
        ``{"value", "low", "high", "resamples", "dropped", "level"}``.
    """
    level = _check_level(level)
    (values,) = _columns(("values",), (values,))
    if values.shape[0] == 0:
        raise ValueError("bootstrap_mean got no values; pass at least one.")
    samples = [values[i].mean() for i in _resampled_indices(values.shape[0], None, resamples, seed)]
    return percentile_summary(values.mean(), samples, level)


# The variance ratio lambda = var(cluster intercept) / var(residual) is profiled over this grid
# (0: no cluster effect, then 1e-3 .. 1e3): a maximum-likelihood fit without an optimiser, the same
# in every resample.
_LAMBDAS = np.concatenate([[0.0], np.logspace(-3, 3, 61)])


def _indicators(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(onehot [n, G], sizes [G])`` of the cluster codes ``groups``."""
    sizes = np.bincount(groups).astype(np.float64)
    onehot = np.zeros((groups.shape[0], sizes.shape[0]))
    onehot[np.arange(groups.shape[0]), groups] = 1.0
    return onehot, sizes


def _profile(y: np.ndarray, design: np.ndarray, groups: np.ndarray, indicators: tuple, lam: float) -> tuple:
    """``(beta, lambda, sigma2, profile log-likelihood)`` at the variance ratio ``lam``
    (``indicators``: :func:`_indicators` of ``groups``)."""
    n = y.shape[0]
    onehot, sizes = indicators
    # V = I + lam Z Z^T is block-diagonal; V^-1 a = a - c_g * (sum of a over group g), c_g = lam / (1 + lam n_g)
    shrink = (lam / (1.0 + lam * sizes))[groups]

    def solve(a: np.ndarray) -> np.ndarray:
        sums = onehot.T @ a
        return a - (shrink.reshape((-1,) + (1,) * (a.ndim - 1))) * sums[groups]

    vx, vy = solve(design), solve(y)
    gram = design.T @ vx
    try:
        beta = np.linalg.solve(gram, design.T @ vy)
    except np.linalg.LinAlgError:
        return np.full(design.shape[1], np.nan), float("nan"), float("nan"), float("nan")
    residual = y - design @ beta
    sigma2 = float(residual @ solve(residual)) / n
    if sigma2 <= 0:
        return beta, float(lam), sigma2, float("inf")
    return beta, float(lam), sigma2, -0.5 * n * math.log(sigma2) - 0.5 * float(np.log1p(lam * sizes).sum())


def _random_intercept(y: np.ndarray, design: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, float, float, float]:
    """``(beta, lambda, sigma2, log-likelihood)`` of the profile-likelihood maximum over :data:`_LAMBDAS`."""
    best, indicators = None, _indicators(groups)
    for lam in _LAMBDAS:
        found = _profile(y, design, groups, indicators, float(lam))
        if math.isnan(found[3]) or found[3] == float("inf"):
            return found
        if best is None or found[3] > best[3]:
            best = found
    return best


def _refined_random_intercept(y: np.ndarray, design: np.ndarray, groups: np.ndarray) -> tuple:
    """:func:`_random_intercept`'s grid maximum, then the maximum between its neighbours on the grid by
    golden-section search: the maximum-likelihood fit to about 1e-10 in lambda, not to the grid's step
    (which moves a standard error by up to about 1%)."""
    best = _random_intercept(y, design, groups)
    if math.isnan(best[3]) or best[3] == float("inf"):
        return best
    at = int(np.argmin(np.abs(_LAMBDAS - best[1])))
    low, high = _LAMBDAS[max(at - 1, 0)], _LAMBDAS[min(at + 1, len(_LAMBDAS) - 1)]
    ratio, indicators = (math.sqrt(5.0) - 1.0) / 2.0, _indicators(groups)
    a, b = float(low), float(high)
    for _ in range(200):
        if b - a <= 1e-12 * max(1.0, b):
            break
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if _profile(y, design, groups, indicators, c)[3] >= _profile(y, design, groups, indicators, d)[3]:
            b = d
        else:
            a = c
    refined = _profile(y, design, groups, indicators, (a + b) / 2.0)
    return refined if refined[3] > best[3] else best


def _design(x, covariates, n: int) -> np.ndarray:
    columns = [np.ones(n), np.asarray(x, dtype=np.float64)]
    if covariates is not None:
        extra = np.asarray(covariates, dtype=np.float64).reshape(n, -1)
        columns += [extra[:, k] for k in range(extra.shape[1])]
    return np.column_stack(columns)


def _group_codes(clusters) -> np.ndarray:
    codes: dict = {}
    return np.array([codes.setdefault(label, len(codes)) for label in clusters])


def random_intercept_fit(y, x, clusters, covariates=None) -> dict:
    """A linear mixed model ``y_i = b0 + b1 x_i + c . covariates_i + u_{g(i)} + e_i`` with a random
    intercept ``u_g ~ N(0, lambda sigma2)`` per cluster ``g`` and ``e_i ~ N(0, sigma2)``, fitted by
    maximum likelihood (beta and sigma2 in closed form by generalised least squares, lambda profiled
    over a grid from 0 to 1e3).

    Args:
        y, x: ``[n]``; clusters: ``[n]`` labels; covariates: ``[n]`` or ``[n, k]``, or ``None``.

    Returns:
        ``{"slope": b1, "coefficients": [b0, b1, c...], "lambda", "sigma2", "intercept_variance":
        lambda sigma2, "log_likelihood", "n", "clusters"}``.
    """
    y, x = _columns(("y", "x"), (y, x))
    groups = _group_codes(clusters)
    if groups.shape[0] != y.shape[0]:
        raise ValueError(f"clusters has {groups.shape[0]} labels for {y.shape[0]} items; give one label per item.")
    beta, lam, sigma2, loglik = _random_intercept(y, _design(x, covariates, y.shape[0]), groups)
    return {
        "slope": float(beta[1]),
        "coefficients": [float(b) for b in beta],
        "lambda": lam,
        "sigma2": sigma2,
        "intercept_variance": lam * sigma2,
        "log_likelihood": loglik,
        "n": int(y.shape[0]),
        "clusters": int(groups.max() + 1),
    }


def _t_summary(value: float, standard_error: float, df: int, level: float) -> dict:
    """``value`` with its Student t interval on ``df`` degrees of freedom (no spread: ``[value, value]``)."""
    if standard_error == 0:
        return {"value": value, "low": value, "high": value, "se": 0.0, "df": df, "level": level}
    half = student_t_quantile((1 + level) / 2, df) * standard_error
    return {"value": value, "low": value - half, "high": value + half, "se": standard_error, "df": df, "level": level}


def _values_by_cluster(values, clusters) -> tuple[np.ndarray, np.ndarray, int]:
    """``(values [n], cluster codes [n] from 0, number of clusters)``, one label per value checked."""
    (y,) = _columns(("values",), (values,))
    groups = _group_codes(clusters)
    if groups.shape[0] != y.shape[0]:
        raise ValueError(f"clusters has {groups.shape[0]} labels for {y.shape[0]} values; give one label per value.")
    return y, groups, (int(groups.max() + 1) if groups.size else 0)


def random_intercept_mean(values, clusters, level: float = 0.95) -> dict:
    """The overall mean ``mu`` of ``values[i] = mu + u_{g(i)} + e_i`` (a random intercept ``u_g ~ N(0,
    tau2)`` per cluster ``g``, ``e_i ~ N(0, sigma2)``), fitted by maximum likelihood (the profile
    likelihood's grid maximum, as :func:`random_intercept_fit` finds it, refined between its grid
    neighbours), with the interval that generalises to other clusters.

    ``mu``'s standard error is the generalised-least-squares one, ``sqrt(sigma2 / sum_g n_g / (1 +
    lambda n_g))`` with ``lambda = tau2 / sigma2``; the interval uses Student t on ``G - 1`` degrees of
    freedom, ``G`` the number of clusters: conservative with few clusters, on purpose (the clusters,
    e.g. starting points of a fine-tuning, are the units an effect must generalise over).

    Args:
        values: ``[n]`` (e.g. per-seed paired differences); clusters: ``[n]`` labels, at least 2
            distinct.

    Returns:
        ``{"value", "low", "high", "se", "df", "level", "tau2", "sigma2", "lambda", "n", "clusters"}``.
    """
    level = _check_level(level)
    y, groups, count = _values_by_cluster(values, clusters)
    if count < 2:
        raise ValueError(f"random_intercept_mean needs values from at least 2 clusters, got {count}.")
    beta, lam, sigma2, _ = _refined_random_intercept(y, np.ones((y.shape[0], 1)), groups)
    sizes = np.bincount(groups).astype(np.float64)
    information = float((sizes / (1.0 + lam * sizes)).sum())
    found = _t_summary(float(beta[0]), math.sqrt(max(sigma2, 0.0) / information), count - 1, level)
    return {**found, "tau2": lam * sigma2, "sigma2": sigma2, "lambda": lam, "n": int(y.shape[0]), "clusters": count}


def fixed_effects_mean(values, clusters, level: float = 0.95) -> dict:
    """The mean over the clusters present, each cluster's mean weighted equally, with a t interval on
    ``n - G`` degrees of freedom from the pooled within-cluster variance: the interval for *these*
    clusters (not for other ones, which :func:`random_intercept_mean` gives).

    ``se = sqrt(s2_within * sum_g 1 / n_g) / G``, ``s2_within`` the pooled within-cluster variance.

    Args:
        values: ``[n]``; clusters: ``[n]`` labels; ``n`` must exceed the number of clusters ``G``.

    Returns:
        ``{"value", "low", "high", "se", "df", "level", "cluster_means", "n", "clusters"}``.
    """
    level = _check_level(level)
    y, groups, count = _values_by_cluster(values, clusters)
    df = int(y.shape[0]) - count
    if count < 1 or df < 1:
        raise ValueError(f"fixed_effects_mean needs more values ({y.shape[0]}) than clusters ({count}).")
    sizes = np.bincount(groups).astype(np.float64)
    means = np.bincount(groups, weights=y) / sizes
    within = float(((y - means[groups]) ** 2).sum()) / df
    found = _t_summary(float(means.mean()), math.sqrt(within * float((1.0 / sizes).sum())) / count, df, level)
    return {**found, "cluster_means": [float(m) for m in means], "n": int(y.shape[0]), "clusters": count}


def holm(p_values: dict, alpha: float = 0.05) -> dict:
    """Holm's step-down correction of a family of tests, each named (e.g. a contrast).

    The ``m`` p-values are sorted, ``p_(0) <= ... <= p_(m-1)`` (ties in the order given); the adjusted
    p-value of the ``i``-th is the running maximum ``max_{j <= i} min(1, (m - j) * p_(j))``, and a test
    is rejected when its adjusted p-value is at most ``alpha``: the same as rejecting ``H_(i)`` while
    ``p_(i) <= alpha / (m - i)`` and stopping at the first that is not. The family-wise error rate is
    at most ``alpha`` under any dependence between the tests.

    Args:
        p_values: ``{name: p}``, each ``p`` a number in ``[0, 1]``.
        alpha: the family-wise level.

    Returns:
        ``{name: {"p", "p_holm", "rejected"}}`` in the order of ``p_values``.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} is not a test level; pass a number between 0 and 1, e.g. 0.05.")
    for name, p in p_values.items():
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"p-value of {name!r} is {p!r}; give a number between 0 and 1.")
    ordered = sorted(p_values, key=lambda name: p_values[name])  # sorted() is stable: ties keep their order
    m, running, adjusted = len(ordered), 0.0, {}
    for i, name in enumerate(ordered):
        running = max(running, min(1.0, (m - i) * float(p_values[name])))
        adjusted[name] = running
    return {
        name: {"p": float(p), "p_holm": adjusted[name], "rejected": adjusted[name] <= alpha}
        for name, p in p_values.items()
    }


def bootstrap_random_intercept_slope(
    y, x, clusters, covariates=None, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> dict:
    """:func:`random_intercept_fit`'s slope of ``x`` with a percentile interval from a cluster
    bootstrap (whole clusters drawn with replacement; a cluster drawn twice counts as two clusters).

    Returns:
        ``{"value", "low", "high", "resamples", "dropped", "level", "fit"}``.
    """
    level = _check_level(level)
    y, x = _columns(("y", "x"), (y, x))
    n = y.shape[0]
    design = _design(x, covariates, n)
    members = _cluster_members(n, list(clusters))
    draws = np.random.default_rng(seed).integers(len(members), size=(resamples, len(members)))
    samples = []
    for row in draws:
        index = np.concatenate([members[c] for c in row])
        groups = np.concatenate([np.full(members[c].shape[0], k) for k, c in enumerate(row)])
        beta = _random_intercept(y[index], design[index], groups)[0]
        samples.append(beta[1])
    fit = random_intercept_fit(y, x, clusters, covariates)
    return {**percentile_summary(fit["slope"], samples, level), "fit": fit}
