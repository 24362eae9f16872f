"""Where ``LongCETrainer``'s token weights come from: one interface, three sources, one selection rule.

The LongCE loss is ``sum_i w_i * nll_i / N``; a ``WeightSource`` says where ``w`` comes from and
what that asks of the trainer:

- ``SelfScoredWeights`` (``longce_weights="self"``, the paper's LongCE): the model being trained
  scores each batch in a short-context pass, and the loss weighs with
  ``min(exp(lp_long - lp_short), gamma)``; no weights in the data, no context parallelism (the
  windows need whole documents on one process).
- ``CachedWeights`` (``longce_weights="cache"``): an evaluator's weights, read from the batch's
  ``longce_weights`` column (``cached_weights.add_key_token_weights``); no short-context pass, and
  context parallelism is allowed (the weights are sharded with their tokens).
- ``NoWeights`` (``longce_weights="none"``): every weight 1, plain cross-entropy through the same loss.

``weight_source_for(config, given)`` turns the ``LongCEConfig`` (or a source of one's own) into one source; ``LongCETrainer``
asks it whether a short-context pass runs, whether context parallelism is allowed, which columns
the batches must keep, and for each batch's weights. A new source is one subclass, given to the
trainer as ``LongCETrainer(..., weight_source=...)``.

Index convention of ``WeightSource.token_weights``: ``[:, k]`` weighs the prediction of token ``k``
of the row (the column's convention, as ``lp[k] = log P(x_k | x_<k)``); the trainer turns them
into per-position weights (position ``t`` predicts token ``t + 1``) once, before context
parallelism shards the sequence.

The setting's values and the column's name are ``config``'s (``WEIGHT_SOURCES``, ``WEIGHTS_COLUMN``),
which imports nothing of this module; the dataset side of the cached weights (``cached_weights``,
which imports ``datasets``) loads when a trainer is built, and imports nothing of this module either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from .config import WEIGHTS_COLUMN


def aligned_weights(weights: torch.Tensor, input_ids: torch.Tensor, key: str, fix: str) -> torch.Tensor:
    """``weights`` as float32 on ``input_ids``' device, or ``ValueError`` naming ``key`` and ``fix``
    when their shape is not ``input_ids``' ``[B, T]``."""
    if tuple(weights.shape) != tuple(input_ids.shape):
        raise ValueError(f"{key} has shape {tuple(weights.shape)} but input_ids {tuple(input_ids.shape)}: {fix}.")
    return weights.to(device=input_ids.device, dtype=torch.float32)


class WeightSource(ABC):
    """Where the token weights of ``LongCETrainer``'s loss come from (see the module docstring).

    Attributes (class-level; a subclass sets those that differ):
        needs_short_pass: the trainer runs its short-context pass and the loss weighs with
            ``min(exp(lp_long - lp_short), gamma)``; ``token_weights`` then returns ``None``.
        allows_context_parallel: ``cp_size > 1`` is allowed; the weights of ``token_weights`` are
            sharded with their tokens.
        batch_columns: dataset / batch columns the source reads; ``remove_unused_columns`` keeps
            them, and they are not passed to the model.
        setting: how error messages name what chose this source.
    """

    needs_short_pass: ClassVar[bool] = False
    allows_context_parallel: ClassVar[bool] = False
    batch_columns: ClassVar[tuple[str, ...]] = ()
    setting: ClassVar[str] = "a custom weight source"

    def prepare(self, trainer: Any) -> None:
        """Check or adapt the trainer's datasets and collator, once, when the trainer is built (default: nothing)."""
        return None

    @abstractmethod
    def token_weights(self, inputs: dict[str, Any], input_ids: torch.Tensor) -> torch.Tensor | None:
        """``[B, T]`` float32 weights of the batch's tokens, on ``input_ids``' device, or ``None``.

        Args:
            inputs: the batch as the collator made it (``input_ids``, ``labels``, the source's columns, ...).
            input_ids: ``[B, T]`` token ids of the batch.
        Returns:
            ``[:, k]`` weighs the prediction of token ``k`` (``[:, 0]`` is never used), finite and
            >= 0 (others are refused at the next log). ``None``: no given weights; the loss weighs
            with the short-context scores (``needs_short_pass``), or with 1 everywhere.
        """

    def context_parallel_refusal(self, cp_size: int) -> str:
        """The one-line error for ``cp_size > 1`` when ``allows_context_parallel`` is False."""
        return (
            f"LongCETrainer supports context parallelism (cp_size={cp_size}) only with longce_weights='cache': "
            f"{self._why_not_context_parallel()}. Use cp_size=1 (DDP, FSDP or DeepSpeed ZeRO shard parameters, "
            "not sequences), or weights from a key-token cache (longce_weights='cache', longce.add_key_token_weights)."
        )

    def unread_column_refusal(self, key: str) -> str:
        """The one-line error for a batch holding weights (``key``) that this source does not read."""
        return (
            f"The batch holds {key!r}, but {self._why_column_unread()}: set longce_weights='cache' to train "
            "with the dataset's weights, or drop the column."
        )

    def _why_not_context_parallel(self) -> str:
        return f"{self.setting} does not shard its weights with the sequence"

    def _why_column_unread(self) -> str:
        return f"{self.setting} does not read it"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _ReadsNoColumn(WeightSource):
    """A source that gives no weights: a batch holding the weights column is a mistake, refused."""

    def token_weights(self, inputs: dict[str, Any], input_ids: torch.Tensor) -> None:
        if inputs.get(WEIGHTS_COLUMN) is not None:
            raise ValueError(self.unread_column_refusal(WEIGHTS_COLUMN))
        return None


class SelfScoredWeights(_ReadsNoColumn):
    """``longce_weights="self"``: the trained model scores each batch (the paper's LongCE)."""

    needs_short_pass = True
    setting = "longce_weights='self'"

    def _why_not_context_parallel(self) -> str:
        return "with 'self' its short-context windows need each document's tokens on one process"

    def _why_column_unread(self) -> str:
        return "longce_weights='self' scores the weights with the trained model"


class NoWeights(_ReadsNoColumn):
    """``longce_weights="none"``: every weight 1, no short-context pass (the plain cross-entropy baseline)."""

    setting = "longce_weights='none' (every weight 1)"


class CachedWeights(WeightSource):
    """``longce_weights="cache"``: an evaluator's weights from the batch's ``longce_weights`` column."""

    allows_context_parallel = True
    batch_columns = (WEIGHTS_COLUMN,)
    setting = "longce_weights='cache'"

    def prepare(self, trainer: Any) -> None:
        """Refuse datasets without the column; wrap the collator in ``LongCEWeightsCollator`` (padding and
        packing collators drop the column)."""
        # Imported here: cached_weights imports `datasets`, which LongCEConfig alone does not need.
        from .cached_weights import LongCEWeightsCollator, check_weights_dataset

        check_weights_dataset(trainer.train_dataset, "training dataset")
        evaluation = trainer.eval_dataset if isinstance(trainer.eval_dataset, dict) else {"": trainer.eval_dataset}
        for name, dataset in evaluation.items():
            check_weights_dataset(dataset, f"evaluation dataset {name}".strip())
        if not isinstance(trainer.data_collator, LongCEWeightsCollator):
            trainer.data_collator = LongCEWeightsCollator(trainer.data_collator)

    def token_weights(self, inputs: dict[str, Any], input_ids: torch.Tensor) -> torch.Tensor:
        weights = inputs.get(WEIGHTS_COLUMN)
        if weights is None:
            raise ValueError(
                f"longce_weights='cache' takes the token weights from the batch's {WEIGHTS_COLUMN!r}, but this batch "
                f"has none (keys {sorted(inputs)}). Build the column with longce.add_key_token_weights and collate "
                "with longce.LongCEWeightsCollator (LongCETrainer wraps its data_collator in one)."
            )
        fix = "one weight per token is needed (collate with longce.LongCEWeightsCollator, which keeps them aligned)"
        return aligned_weights(weights, input_ids, WEIGHTS_COLUMN, fix)


#: The source of each ``longce_weights`` value (``config.WEIGHT_SOURCES``, in this order).
SOURCE_OF_SETTING: dict[str, type[WeightSource]] = {
    "self": SelfScoredWeights,
    "cache": CachedWeights,
    "none": NoWeights,
}


def weight_source_for(config: Any, given: WeightSource | None = None) -> WeightSource:
    """The ``WeightSource`` of a trainer: ``given`` (a source of one's own), else the one that the
    ``LongCEConfig`` ``config`` chooses: the source of ``config.longce_weights`` (``SOURCE_OF_SETTING``).
    ``config`` is checked already; a ``given`` that is no ``WeightSource``, or beside a config that
    chooses a source other than the default, is a ``ValueError``."""
    chosen = SOURCE_OF_SETTING[config.longce_weights]()
    if given is None:
        return chosen
    if not isinstance(given, WeightSource):
        raise ValueError(
            f"weight_source must be a longce.weight_sources.WeightSource, got {type(given).__name__}; "
            "subclass WeightSource, or leave it None to use longce_weights."
        )
    if type(chosen) is not SelfScoredWeights:  # the settings' default source: left to the given one
        raise ValueError(
            f"weight_source={given!r} and {chosen.setting} both say where the weights come from; "
            "give only one of them (leave longce_weights at its default)."
        )
    return given
