"""Every name this sub-package takes from ``longppl`` beyond its public ``__all__``, in one place.

The integration reuses the scoring path of ``longppl evaluate`` as it is (that is what makes the
numbers equal); these are the few pieces of it that ``import longppl`` does not export.
"""

from __future__ import annotations

from longppl.commandline.running import USER_ERRORS, closest, debugging, with_closest
from longppl.core.scoring import DocumentResult, corpus_values, document_columns, encode_texts
from longppl.settings import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    require_aggregation,
    require_bool,
    require_int,
)

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_AGGREGATION",
    "DEFAULT_MAX_TOKENS_PER_BATCH",
    "USER_ERRORS",
    "DocumentResult",
    "closest",
    "corpus_values",
    "debugging",
    "document_columns",
    "encode_texts",
    "require_aggregation",
    "require_bool",
    "require_int",
    "with_closest",
]
