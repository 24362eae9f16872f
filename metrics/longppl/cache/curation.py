"""Per-document columns for curating a corpus, from a key-token cache (no forward pass).

The cache stores the evaluator's long- and short-context log-probs of every token, so everything
below follows from the rows already scored: a corpus can be filtered or ranked by how much it needs
long context, under any key-token rule, without running the evaluator again.

Columns of :func:`curation_table`, one row per document (``n`` evaluator tokens, index ``i`` as in
``logprobs``; "scored" tokens are those with a short-context score, ``i >= K``):

==================  =========  =================================================================
column              type       meaning
==================  =========  =================================================================
text_fingerprint    string     the row's key in the cache (``fingerprints.text_fingerprint``)
text                string     the text scored
tokens              int64      ``n``
scored_tokens       int64      tokens with a short-context score, ``max(n - K, 0)``
key_tokens          int64      key tokens under the rule (``LSD > alpha`` and ``LCL > beta``)
key_share           float64    ``key_tokens / tokens`` (what ``longppl score`` reports)
lsd_mean            float64    mean LSD over the scored tokens (NaN without any)
lsd_p90             float64    90th percentile of the scored tokens' LSD (linear interpolation)
longppl             float64    the evaluator's own LongPPL: ``exp(-mean lp_long)`` over key tokens
ppl                 float64    the evaluator's own PPL: ``exp(-mean lp_long)`` over ``i >= 1``
benefit_near        float64    sum of LSD over scored tokens with ``K <= i < 2K``
benefit_far         float64    sum of LSD over scored tokens with ``i >= 2K``
==================  =========  =================================================================

``benefit_near + benefit_far`` is the document's total LSD: how much the long context raised the
log-likelihood of its tokens, split by where the token sits: within twice the short window (the
long context adds less than ``K`` tokens) or beyond it (the long context reaches far back).
NaN marks a value that does not exist (no scored token, no key token).
"""

from __future__ import annotations

from collections.abc import Sequence

import datasets
import numpy as np

from ..rules.key_tokens import key_token_mask, long_short_difference
from ..settings import KeyTokenRule

CURATION_FEATURES = datasets.Features(
    {
        "text_fingerprint": datasets.Value("string"),
        "text": datasets.Value("string"),
        "tokens": datasets.Value("int64"),
        "scored_tokens": datasets.Value("int64"),
        "key_tokens": datasets.Value("int64"),
        "key_share": datasets.Value("float64"),
        "lsd_mean": datasets.Value("float64"),
        "lsd_p90": datasets.Value("float64"),
        "longppl": datasets.Value("float64"),
        "ppl": datasets.Value("float64"),
        "benefit_near": datasets.Value("float64"),
        "benefit_far": datasets.Value("float64"),
    }
)


def _mean_nll_exp(values: np.ndarray) -> float:
    return float(np.exp(-values.astype(np.float64).mean())) if values.size else float("nan")


def curation_columns(lp_long: np.ndarray, lp_short: np.ndarray, trunc_len: int, rule: KeyTokenRule) -> dict:
    """The numeric columns of one document (table in the module docstring).

    Args:
        lp_long: ``[n]`` float, NaN at ``i = 0``.
        lp_short: ``[n]`` float, NaN for ``i < trunc_len``.
        trunc_len: ``K`` of the rows.
        rule: the key-token rule (``alpha``, ``beta``, ``use_lcl``).
    """
    n = int(lp_long.shape[0])
    lsd = long_short_difference(lp_long, lp_short).astype(np.float64)
    scored = np.isfinite(lsd)
    key = key_token_mask(lp_long, lp_short, rule)
    position = np.arange(n)
    near, far = scored & (position < 2 * trunc_len), scored & (position >= 2 * trunc_len)
    finite_long = lp_long[np.isfinite(lp_long)]
    return dict(
        tokens=n,
        scored_tokens=int(scored.sum()),
        key_tokens=int(key.sum()),
        key_share=float(key.sum() / n) if n else float("nan"),
        lsd_mean=float(lsd[scored].mean()) if scored.any() else float("nan"),
        lsd_p90=float(np.percentile(lsd[scored], 90)) if scored.any() else float("nan"),
        longppl=_mean_nll_exp(lp_long[key]),
        ppl=_mean_nll_exp(finite_long),
        benefit_near=float(lsd[near].sum()),
        benefit_far=float(lsd[far].sum()),
    )


def curation_table(cache, rows: Sequence[int], trunc_len: int, rule: KeyTokenRule = KeyTokenRule()) -> datasets.Dataset:
    """The curation columns of ``rows`` of a ``KeyTokenCache`` (rows of one evaluator and
    settings, e.g. from :meth:`KeyTokenCache.select`), as a ``Dataset`` with ``CURATION_FEATURES``,
    one row per cache row, in the order of ``rows``."""
    columns: dict[str, list] = {name: [] for name in CURATION_FEATURES}
    for row in rows:
        scores = cache.scores(row)
        scalar = cache.row(row)
        values = curation_columns(scores.lp_long, scores.lp_short, trunc_len, rule)
        values.update(text_fingerprint=scalar["text_fingerprint"], text=scalar["text"])
        for name in CURATION_FEATURES:
            columns[name].append(values[name])
    return datasets.Dataset.from_dict(columns, features=CURATION_FEATURES)
