"""``LongCETrainer``: a drop-in ``transformers.Trainer`` whose loss up-weights long-context tokens.

Per batch (paper Sec. 3.2, App. A.2), with the model being trained as its own scorer:

1. short-context pass, ``torch.no_grad()``, model in eval mode: every document of the batch is cut
   into the K/d windows of ``longppl.core.windows`` (never across a document boundary), packed into few
   forward passes, giving ``lp_short`` for each token with at least ``K + d`` tokens before it in
   its document (the first window is the tokens' full context: LSD exactly 0; a token without a short
   score weighs ``min(1, gamma)``, as the official LongCE's does);
2. gradient pass: the model's own forward, its LM head intercepted so that the weighted loss
   ``sum_i w_i * nll_i`` with ``w_i = min(exp(lp_long[i] - lp_short[i]), gamma)`` (``lp_long``
   from this very pass, detached) is computed from hidden states a chunk at a time, without a
   ``[tokens, vocabulary]`` logits tensor (``lm_head_loss``);
3. ``loss = sum_i w_i * nll_i / N``, ``N`` = label tokens of the batch, or ``num_items_in_batch``
   when the Trainer counts them over gradient accumulation (and processes), exactly like the
   stock causal-LM loss; with all weights 1 it *is* the stock loss.

The model's output carries a ``[B, T, 0]`` stand-in for its logits, except in ``evaluate()`` /
``predict()`` when predictions are gathered (``prediction_loss_only=False``: a ``compute_metrics``
is set, or ``predict()``): then the head also returns the real ``[B, T, V]`` logits, exactly the
model's own, which cost what they cost the stock ``Trainer``. Evaluation with loss only keeps the
memory saving.

Where ``w`` comes from is the trainer's ``WeightSource`` (``weight_sources``), chosen once from the
settings: with ``LongCEConfig(longce_weights="cache")`` step 1 is skipped and ``w`` comes from the
batch's ``longce_weights`` column (an evaluator's weights from a key-token cache, ``cached_weights``),
so a step costs what a plain cross-entropy step costs, and context parallelism is allowed
(``cp_size > 1``, torch's ring attention under FSDP2): the weights are sharded along the sequence
with the tokens they weigh (``_prepare_context_parallel_inputs``). ``longce_weights="none"`` skips
step 1 too, with every weight 1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from longppl.core.compilation import compiled_blocks
from longppl.core.logprobs import CausalLMHead, intercept_head, resolve_lm_head

from .config import LongCEConfig, _LongCESettings, as_longce_config
from .documents import batch_documents, batch_short_log_probs, count_window_passes
from .lm_head_loss import select_lm_head_loss
from .weight_sources import WEIGHTS_COLUMN, WeightSource, aligned_weights, weight_source_for

logger = logging.getLogger(__name__)

#: What replaces the deprecated ``LongCETrainer.longce`` (one release more, then removed).
TRAINER_SETTINGS_DEPRECATION = (
    "LongCETrainer.longce (a LongCESettings) is deprecated and will be removed in the next release: read and set "
    "the longce_* fields of trainer.args, its LongCEConfig (e.g. trainer.args.longce_gamma)."
)

# Logged besides the loss, per mode; evaluation prefixes its metric_key_prefix ("eval_", "test_").
_STAT_KEYS = ("ce_loss", "longce_mean_weight", "longce_weight_gt1_share", "longce_max_weight")

#: Batch key of the cached weights shifted like ``shift_labels`` (``[B, T]``: ``[:, t]`` weighs the
#: prediction made at position ``t``, of token ``t + 1``). Context parallelism shards it with the
#: tokens; a rank's shard cannot be shifted on its own (its last position predicts another rank's token).
SHIFT_WEIGHTS = "longce_shift_weights"


def _output_logits(outputs: Any) -> torch.Tensor:
    """The ``logits`` of a model's output (a ``ModelOutput`` or, with ``return_dict=False``, a tuple)."""
    return outputs.logits if hasattr(outputs, "logits") else outputs[0]


def _to_positions(values: torch.Tensor, fill: float) -> torch.Tensor:
    """``[B, T]`` per-position values from per-token ``values`` ``[B, T]``.

    Position ``t`` of a row predicts token ``t + 1``: it gets ``values[:, t + 1]`` (a short-context
    score or a given weight, both indexed by the token they concern), ``fill`` at ``t = T - 1``,
    which predicts nothing.
    """
    shifted = torch.full_like(values, fill)
    shifted[:, :-1] = values[:, 1:]
    return shifted


def _perplexity(mean_nll: float) -> float:
    """``exp(mean_nll)``, ``inf`` past float range (as run_clm reports an overflowing perplexity)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return float("inf")


def _refuse_bad_weights(mode: str, nan: float, infinite: float, negative: float) -> None:
    """Raise ``ValueError`` if given weights of ``mode``'s batches were NaN, infinite or negative (counts)."""
    found = [f"{int(n)} {what}" for n, what in ((nan, "NaN"), (infinite, "infinite"), (negative, "negative")) if n]
    if found:
        raise ValueError(
            f"The batches' {WEIGHTS_COLUMN} ({mode}, since the last log) hold {', '.join(found)} weight(s) at trained "
            "positions; every weight must be a finite number >= 0. Build the column with longce.add_key_token_weights "
            "and collate with longce.LongCEWeightsCollator (both refuse such values), or fix the weights passed to "
            "compute_loss."
        )


class LongCETrainer(Trainer):
    """``Trainer`` with the LongCE loss; use it with ``LongCEConfig`` (plain ``TrainingArguments`` are converted
    into one, with the defaults).

    Everything else is stock ``Trainer``: data collators (padding or ``DataCollatorWithFlattening``),
    PEFT, gradient accumulation, bf16, activation (gradient) checkpointing, DDP / FSDP / DeepSpeed through
    accelerate. Besides the loss it logs, reduced across processes: ``ce_loss`` (unweighted
    cross-entropy), ``longce_mean_weight``, ``longce_weight_gt1_share`` and ``longce_max_weight``;
    ``evaluate()`` and ``predict()`` return them with their prefix (``eval_ce_loss``, ``test_ce_loss``, ...).
    Predictions (``compute_metrics``, ``predict()``) get the model's real ``[B, T, V]`` logits.

    ``eval_loss`` is the loss being trained, the LongCE-weighted one (with ``longce_weights="none"``,
    plain CE), so ``exp(eval_loss)`` (run_clm's "perplexity") is not a perplexity. ``eval_ce_loss`` is
    the plain cross-entropy averaged over every label token of the evaluation set, and
    ``eval_perplexity = exp(eval_ce_loss)``: what a stock ``Trainer`` + run_clm reports as
    ``exp(eval_loss)`` for the same model and data. (Stock ``eval_loss`` averages per-batch token means,
    each weighted by its batch's sequences: the same number whenever the sequences have equal label
    counts, as run_clm's blocks do, however the last batch is cut; with sequences of unequal lengths ours
    stays the token-averaged corpus value.) To select checkpoints by plain CE, set
    ``metric_for_best_model`` to ``eval_ce_loss`` or ``eval_perplexity`` (``LongCEConfig`` then makes
    ``greater_is_better`` False for the latter too).

    Batches need ``input_ids`` and ``labels`` (``-100`` = ignored; the model predicts ``labels[t+1]``
    from position ``t``, or ``shift_labels[t]`` when the collator provides them), optionally
    ``attention_mask`` and ``position_ids``, and the columns of the weight source: with
    ``longce_weights="cache"``, ``longce_weights`` (``[B, T]`` float32, one weight per token,
    ``cached_weights.LongCEWeightsCollator``). Given weights that are NaN, infinite or negative are
    counted on the device and refused with a ``ValueError`` at the next log.

    Context parallelism (accelerate's ``ParallelismConfig(cp_size=...)`` with FSDP2) runs with a source
    that allows it (``longce_weights="cache"``): the Trainer shards ``input_ids``, ``shift_labels`` and
    ``position_ids`` along the sequence, and the weights, shifted like ``shift_labels``, with them.
    ``"self"`` refuses it (its short-context windows need whole documents on one process), and
    sequence parallelism (``sp_size``, DeepSpeed Ulysses) is refused with every source.

    Args:
        weight_source: a ``WeightSource`` of one's own (a subclass, e.g. weights from another scorer);
            ``None`` (default): the one the ``longce_weights`` setting chooses, which must then be left
            at its default. ``args``: a ``LongCEConfig``; plain ``TrainingArguments`` are converted into
            one once, here (``config.as_longce_config``: their fields kept, the ``longce_*`` ones at their
            defaults), as TRL's trainers convert theirs. Every other argument is ``Trainer``'s.

    Attributes:
        args: the ``LongCEConfig``; the trainer reads its ``longce_*`` fields.
        lm_head_loss: the ``LMHeadLoss`` that computes the weighted loss from the final hidden states,
            chosen by ``longce_loss_kernel`` (``lm_head_loss.select_lm_head_loss``).
        weight_source: the ``WeightSource`` of the token weights (``weight_sources.weight_source_for``).
    """

    args: LongCEConfig

    def __init__(
        self,
        model: nn.Module | None = None,
        args: Any = None,
        *rest: Any,
        weight_source: WeightSource | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, as_longce_config(args), *rest, **kwargs)
        self.lm_head_loss = select_lm_head_loss(
            self.args.longce_loss_kernel, self.args.device, self.args.longce_loss_chunk_bytes
        )
        self._given_weight_source = weight_source
        self.weight_source.prepare(self)  # also refuses a weight_source beside settings that choose one
        resolve_lm_head(self.model)  # raises a clear ValueError for models without a causal LM head
        if self.args.n_gpu > 1:
            # nn.DataParallel splits each batch inside the forward, where the intercepted LM head would
            # see a slice of the batch it scores; one process per GPU (DDP) is also the faster setup.
            raise ValueError(
                f"LongCETrainer does not support torch.nn.DataParallel ({self.args.n_gpu} GPUs in one process). "
                "Launch one process per GPU (`accelerate launch` or `torchrun`: DDP, FSDP, DeepSpeed), or make one "
                "GPU visible (CUDA_VISIBLE_DEVICES=0)."
            )
        self._refuse_context_parallelism()
        # Our loss is normalised by `num_items_in_batch` (counted over gradient accumulation), so the
        # Trainer must count it and must not divide by the accumulation steps again.
        self.model_accepts_loss_kwargs = True
        self._longce_stats: dict[str, torch.Tensor] = {}
        self._longce_want_logits = False  # set by prediction_step while predictions are gathered
        self._longce_warned_no_windows = False

    @property
    def longce(self) -> Any:
        """Deprecated (removed in the next release): read the ``longce_*`` fields of ``self.args`` (its
        ``LongCEConfig``) instead. Returns them as the deprecated ``LongCESettings``, with a ``FutureWarning``."""
        warnings.warn(TRAINER_SETTINGS_DEPRECATION, FutureWarning, stacklevel=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # one warning, this one
            return _LongCESettings.from_args(self.args)

    @longce.setter
    def longce(self, value: Any) -> None:
        raise AttributeError(f"LongCETrainer.longce can no longer be set. {TRAINER_SETTINGS_DEPRECATION}")

    @property
    def weight_source(self) -> WeightSource:
        """The ``WeightSource`` of the token weights: the one given to ``__init__``, else the one that
        ``args.longce_weights`` chooses (``weight_source_for``, the one place it becomes a source).

        Built once per (setting, given source), not on each of the several questions a training
        step asks it; code that sets ``args.longce_weights`` anew gets the new source."""
        key = (self.args.longce_weights, self._given_weight_source)
        built = getattr(self, "_weight_source_of", None)
        if built is None or built[0][0] != key[0] or built[0][1] is not key[1]:
            built = (key, weight_source_for(self.args, key[1]))
            self._weight_source_of = built
        return built[1]

    def _refuse_context_parallelism(self) -> None:
        """Refuse sequence parallelism, and context parallelism unless the weight source allows it.

        Given weights only need to travel with their tokens (``_prepare_context_parallel_inputs``);
        self-scored ones need each document whole on one process for its short-context windows.
        DeepSpeed's sequence parallelism shards the batch in its own data-loader adapter, which
        would have to shard the weights too; it stays refused (untried).
        """
        config = getattr(self.accelerator, "parallelism_config", None) or getattr(self.args, "parallelism_config", None)
        cp_size = getattr(config, "cp_size", 1) or 1
        sp_size = getattr(config, "sp_size", 1) or 1
        if sp_size > 1:
            raise ValueError(
                f"LongCETrainer does not support sequence parallelism (sp_size={sp_size}, DeepSpeed Ulysses): nothing "
                "shards its weights or short-context windows with the sequence there. Use sp_size=1; with "
                "longce_weights='cache', context parallelism (cp_size > 1, FSDP2) shards long sequences instead."
            )
        source = self.weight_source
        if cp_size > 1 and not source.allows_context_parallel:
            raise ValueError(source.context_parallel_refusal(cp_size))

    def _prepare_context_parallel_inputs(
        self, model: nn.Module, inputs: dict[str, Any]
    ) -> tuple[Callable[[], Any], dict[str, Any]]:
        """``Trainer``'s context-parallel preparation, with the given weights sharded like ``shift_labels``.

        Under context parallelism ``Trainer`` adds ``shift_labels`` (``[B, T]``) to ``inputs`` and
        returns a context that shards its buffers (``input_ids``, ``labels``, ``shift_labels``,
        ``attention_mask``, ``position_ids``) along dim 1, in place, with one split for all. The
        weight source's weights join those buffers as ``longce_shift_weights`` ``[B, T]`` (``[:, t]`` =
        ``longce_weights[:, t + 1]``, 1 at ``t = T - 1``), so each rank gets the weights of exactly
        the predictions it makes; the source's columns leave ``inputs``. Without context
        parallelism, or with a source that gives no weights, ``inputs`` are returned as they are.
        """
        cp_context, inputs = super()._prepare_context_parallel_inputs(model, inputs)
        source = self.weight_source
        if cp_context is contextlib.nullcontext or not source.allows_context_parallel:
            return cp_context, inputs
        shifted = self._position_weights(inputs, inputs["input_ids"])  # [B, T], checked, before sharding
        if shifted is None:
            return cp_context, inputs
        keywords = getattr(cp_context, "keywords", None) or {}
        if not isinstance(cp_context, functools.partial) or "buffers" not in keywords:
            # Trainer changed how it hands the buffers over: unsharded weights would weigh the wrong tokens.
            raise RuntimeError(
                "LongCETrainer cannot add its weights to this transformers version's context-parallel buffers "
                f"({type(cp_context).__name__}); train with cp_size=1."
            )
        for column in source.batch_columns:
            inputs.pop(column, None)
        inputs[SHIFT_WEIGHTS] = shifted
        return (
            functools.partial(
                cp_context.func,
                *cp_context.args,
                **{
                    **keywords,
                    "buffers": [*keywords["buffers"], shifted],
                    "buffer_seq_dims": [*keywords["buffer_seq_dims"], 1],
                    "no_restore_buffers": {*(keywords.get("no_restore_buffers") or ()), shifted},
                },
            ),
            inputs,
        )

    def _set_signature_columns_if_needed(self) -> None:
        """``Trainer``'s columns to keep (the model's forward arguments, labels) and the weight source's
        (``longce_weights`` with cached weights), which ``remove_unused_columns`` would otherwise drop."""
        super()._set_signature_columns_if_needed()
        for column in self.weight_source.batch_columns:
            if column not in self._signature_columns:
                self._signature_columns.append(column)

    # ------------------------------------------------------------------ loss

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """LongCE loss of one batch (see the module docstring); signature of ``Trainer.compute_loss``."""
        input_ids, targets = self._validated_targets(inputs)
        rows, cols = (targets != -100).nonzero(as_tuple=True)  # the trained positions (one host sync)
        # A batch without labels is one micro-batch of several counted by `num_items_in_batch` (gradient
        # accumulation, other processes): it adds 0 to the loss and its gradients, as in stock Trainer. Alone
        # (the count is 0, or there is none) its loss would be 0/0.
        if rows.numel() == 0 and (num_items_in_batch is None or int(num_items_in_batch) == 0):
            raise ValueError(
                "Every label of this batch is -100, so there is no token to train on (the loss would be 0/0). "
                "Check the collator / masking: at least one position needs a real label."
            )
        head = resolve_lm_head(self.accelerator.unwrap_model(model))
        batch, length = input_ids.shape

        source = self.weight_source
        given = self._position_weights(inputs, input_ids)  # [B, T] aligned with targets, or None
        flat = rows * length + cols
        if given is not None or not source.needs_short_pass:  # lp_short is unused: the weights are given
            lp_short = torch.full((flat.numel(),), float("nan"), device=input_ids.device)  # [N]
        else:
            short = self._short_context_pass(model, head, inputs)  # [B, T], per token
            lp_short = _to_positions(short, float("nan")).reshape(-1)[flat]  # [N]
        # Given weights [N] replace min(exp(LSD), gamma) in the loss; None: they come from lp_short.
        weights = None if given is None else given.reshape(-1)[flat]
        if weights is None and not source.needs_short_pass:  # neither given nor scored: plain CE, every weight 1
            weights = torch.ones(flat.numel(), device=input_ids.device)
        result: dict[str, torch.Tensor] = {}
        # Real logits only when prediction_step gathers them (under no_grad); training never pays for them.
        real_logits = return_outputs and self._longce_want_logits and not torch.is_grad_enabled()

        def consume(hidden: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
            trained = hidden.reshape(batch * length, -1)[flat]  # [N, H]
            if flat.numel() == 0:  # no label: loss 0, still through the head (zero gradients, as stock Trainer's)
                empty = trained.new_zeros(0, dtype=torch.float32)
                result["loss"], result["nll"], result["weight"] = project(trained).float().sum(), empty, empty
            else:
                result["loss"], result["nll"], result["weight"] = self.lm_head_loss(
                    head, trained, project, targets.reshape(-1)[flat], lp_short, self.args.longce_gamma, weights
                )
            if real_logits:
                return project(hidden)  # the model post-processes it (soft-capping, scaling) as usual
            # The model's output must depend on the loss: DDP (find_unused_parameters=True, Trainer's
            # default without checkpointing and for PEFT) walks back from it to find used parameters.
            return hidden.new_zeros(*hidden.shape[:-1], 0) + 0 * result["loss"]

        not_for_model = ("labels", "shift_labels", WEIGHTS_COLUMN, SHIFT_WEIGHTS, *source.batch_columns)
        model_inputs = {k: v for k, v in inputs.items() if k not in not_for_model}
        with intercept_head(head, consume):
            outputs = model(**model_inputs, use_cache=False)
        if "loss" not in result:
            raise RuntimeError(
                f"The LM head of {type(head.model).__name__} was not called by its forward; LongCETrainer needs a "
                "*ForCausalLM model that projects its final hidden states through get_output_embeddings()."
            )

        denominator = num_items_in_batch if num_items_in_batch is not None else rows.numel()
        # The loss leaves the model through its output too (the stand-in logits, [B, T, 0], sum 0):
        # DeepSpeed ZeRO-3 gathers a module's partitioned weights for backward in hooks on the
        # module's outputs, so a loss reaching the head only through our closure would give the
        # head's weight a full-size gradient while that weight is partitioned.
        stand_in = 0 if real_logits else _output_logits(outputs).sum()
        loss = (result["loss"] + stand_in) / denominator
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # Mirror Trainer: num_items_in_batch counts every process's tokens (tensor-parallel ranks share
            # one batch), and DDP averages gradients. (nn.DataParallel is refused in __init__.)
            loss = loss * (self.accelerator.num_processes // max(self.get_tp_size(), 1))
        self._record_stats(model.training, result["nll"], result["weight"], weights)
        return (loss, outputs) if return_outputs else loss

    @staticmethod
    def _validated_targets(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [B, T]`` and ``targets [B, T]``: ``targets[:, t]`` is the token position ``t`` predicts."""
        missing = [k for k in ("input_ids", "labels") if inputs.get(k) is None]
        if "labels" in missing and inputs.get("shift_labels") is not None:
            missing.remove("labels")
        if missing:
            raise ValueError(
                f"LongCETrainer needs {' and '.join(missing)} in every batch (got keys {sorted(inputs)}). Use a "
                "causal-LM collator, e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False) or "
                "DataCollatorWithFlattening(), and keep remove_unused_columns from dropping them."
            )
        input_ids = inputs["input_ids"]
        if inputs.get("shift_labels") is not None:
            targets = inputs["shift_labels"]
        else:
            labels = inputs["labels"]
            targets = torch.full_like(labels, -100)
            targets[:, :-1] = labels[:, 1:]
        if targets.shape != input_ids.shape:
            raise ValueError(f"labels have shape {tuple(targets.shape)} but input_ids {tuple(input_ids.shape)}.")
        return input_ids, targets

    def _position_weights(self, inputs: dict[str, Any], input_ids: torch.Tensor) -> torch.Tensor | None:
        """``[B, T]`` float32 weight of the prediction at each position from the weight source, or ``None``
        (the source gives none: self-scored or plain CE).

        Position ``t`` predicts token ``t + 1``: it gets the source's ``token_weights[:, t + 1]`` (1 at
        ``t = T - 1``, which predicts nothing), or ``longce_shift_weights[:, t]``, shifted already (under
        context parallelism ``_prepare_context_parallel_inputs`` shifts them before the sequence is sharded).
        """
        if SHIFT_WEIGHTS in inputs:  # shifted before context parallelism sharded the sequence
            source = self.weight_source
            if not source.allows_context_parallel:  # only put there for sources that allow it
                raise ValueError(source.unread_column_refusal(SHIFT_WEIGHTS))
            fix = "under context parallelism the weights must be sharded with the tokens"
            return aligned_weights(inputs[SHIFT_WEIGHTS], input_ids, SHIFT_WEIGHTS, fix)
        given = self._batch_weights(inputs, input_ids)  # [B, T], indexed by the token they weigh
        return None if given is None else _to_positions(given, 1.0)

    def _batch_weights(self, inputs: dict[str, Any], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The weight source's ``[B, T]`` float32 weights of the batch's tokens, or ``None``
        (``WeightSource.token_weights``, which checks the batch)."""
        return self.weight_source.token_weights(inputs, input_ids)

    def _short_context_pass(self, model: nn.Module, head: CausalLMHead, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B, T]`` short-context log-probs (NaN where none), same number of forwards on every process."""
        input_ids = inputs["input_ids"]
        ids = input_ids.cpu()  # windows are cut on the host: one copy, shared by counting and scoring
        documents = batch_documents(ids, inputs.get("attention_mask"), inputs.get("position_ids"))
        window, budget = self.args.longce_window, self.args.longce_max_tokens_per_batch
        passes = count_window_passes(ids, documents, window, budget)
        if passes == 0:
            self._warn_no_windows(documents)
        most = passes
        if self.accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized():
            # ZeRO-3 and FSDP gather parameters in every forward: unequal counts across ranks deadlock.
            count = torch.tensor([passes], device=self.accelerator.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            most = int(count.item())
        # DDP's wrapper would broadcast buffers in each forward; its module holds the full weights.
        scorer = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        was_training = scorer.training
        scorer.eval()  # no dropout in the scores; gradient checkpointing off for no_grad passes
        try:
            with torch.no_grad(), compiled_blocks(scorer, enabled=self.args.longce_compile_windows and passes > 0):
                lp_short = batch_short_log_probs(scorer, ids, documents, window, budget).to(input_ids.device)
                for _ in range(most - passes):  # idle passes keep the ranks' collectives in step
                    with intercept_head(head, lambda hidden, project: None):
                        scorer(input_ids=input_ids[:1, :1], use_cache=False)
        finally:
            scorer.train(was_training)
        return lp_short

    def _warn_no_windows(self, documents: list) -> None:
        """Warn (once per trainer) that a batch got no short-context window: its loss is plain CE."""
        if self._longce_warned_no_windows:
            return
        self._longce_warned_no_windows = True
        K, d = self.args.longce_trunc_len, self.args.longce_sliding_window
        longest = max((doc.end - doc.start for doc in documents), default=0)
        logger.warning(
            "LongCE: no document of this batch is longer than K + d = %d tokens (longest: %d; longce_trunc_len "
            "K=%d, longce_sliding_window d=%d), so no token has a short-context score and every weight is "
            "min(1, gamma): the batch trains with (scaled) plain cross-entropy. Use sequences longer than K + d (e.g. a larger max_seq_length) "
            "or a smaller longce_trunc_len. (Warned once per trainer.)",
            K + d,
            longest,
            K,
            d,
        )

    # --------------------------------------------------------------- logging

    def _record_stats(
        self, training: bool, nll: torch.Tensor, weight: torch.Tensor, given: torch.Tensor | None = None
    ) -> None:
        """Accumulate on the device (no host sync per step): sums of nll, weight, count, weight > 1; max
        weight; and the NaN, infinite and negative values among the ``given`` weights ``[N]`` of the
        trained positions (a weight source's, e.g. ``longce_weights="cache"``), which ``_reduced_stats``
        refuses at the next log.

        The collator refuses such weights row by row on the host; batches that reach ``compute_loss``
        another way are checked here, folded into statistics that are synced at log time anyway.
        """
        mode = "train" if training else "eval"
        given = weight.new_zeros(0) if given is None else given.detach()
        step = torch.stack(
            [
                nll.sum(),
                weight.sum(),
                torch.tensor(float(nll.numel()), device=nll.device),
                (weight > 1).sum().float(),
                weight.max() if weight.numel() else weight.new_zeros(()),
                torch.isnan(given).sum().float(),
                torch.isinf(given).sum().float(),
                (given < 0).sum().float(),
            ]
        )
        previous = self._longce_stats.get(mode)
        if previous is None:
            self._longce_stats[mode] = step.detach()
        else:
            merged = previous + step.detach()
            merged[4] = torch.maximum(previous[4], step[4].detach())
            self._longce_stats[mode] = merged

    def _reduced_stats(self, mode: str, prefix: str) -> dict[str, float]:
        """The LongCE statistics of ``mode`` since they were last taken, reduced over processes (collective).

        Evaluation also gets ``{prefix}perplexity``: ``exp`` of the cross-entropy summed over every label
        token of every process's batches, divided by their number (``ce_loss`` before rounding).
        """
        stats = self._longce_stats.pop(mode, None)
        if stats is None:
            return {}
        gathered = self.accelerator.gather(stats[None].to(self.accelerator.device))  # [processes, 8]
        nll_sum, weight_sum, count, above_one, _, nan, infinite, negative = gathered.sum(0).tolist()
        _refuse_bad_weights(mode, nan, infinite, negative)  # every process gathered the same counts: all raise
        values = (nll_sum / count, weight_sum / count, above_one / count, gathered[:, 4].max().item())
        stats = {prefix + key: round(value, 6) for key, value in zip(_STAT_KEYS, values)}
        if mode == "eval":
            # `eval_loss` is the LongCE-weighted loss, so run_clm's exp(eval_loss) is not a perplexity here.
            stats[prefix + "perplexity"] = _perplexity(nll_sum / count)
        return stats

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``Trainer.prediction_step``; the logits are real (``[B, T, V]``) unless ``prediction_loss_only``."""
        self._longce_want_logits = not prediction_loss_only
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._longce_want_logits = False

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """``Trainer.evaluation_loop`` whose metrics also hold the LongCE statistics (``{prefix}_ce_loss``, ...)
        and ``{prefix}_perplexity``, ``exp({prefix}_ce_loss)`` (the class docstring says why not ``exp(eval_loss)``)."""
        self._longce_stats.pop("eval", None)  # left over from an interrupted loop
        output = super().evaluation_loop(
            dataloader,
            description,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        output.metrics.update(self._reduced_stats("eval", f"{metric_key_prefix}_"))
        return output

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Merge the training statistics since the last log (reduced over processes) into training logs.

        Training logs are those with ``loss`` (every ``logging_steps``) or ``train_loss`` (the end of
        ``train()``); evaluation metrics already hold theirs (``evaluation_loop``).
        """
        if "loss" in logs or "train_loss" in logs:
            logs.update(self._reduced_stats("train", ""))
        super().log(logs, *args, **kwargs)
