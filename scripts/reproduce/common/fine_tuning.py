"""What the experiments' LongCE fine-tuning runs share: a ``LongCETrainer`` that reads its dataset in
order, and a callback that times each optimizer step."""

from __future__ import annotations

import time
from collections.abc import Callable


def in_order_trainer():
    """``LongCETrainer`` reading its dataset in order (the order is the dataset's, set by the seed)."""
    from torch.utils.data import SequentialSampler

    from longce import LongCETrainer

    class InOrder(LongCETrainer):
        def _get_train_sampler(self, *args, **kwargs):  # the signature differs across transformers versions
            dataset = args[0] if args and args[0] is not None else kwargs.get("train_dataset") or self.train_dataset
            return SequentialSampler(dataset)

    return InOrder


def step_timer(step_seconds: list[float], on_gpu: bool, after_step: Callable | None = None):
    """A ``TrainerCallback`` appending each optimizer step's seconds to ``step_seconds`` (synchronised
    on the GPU), then calling ``after_step(state, model)`` outside the timing (accuracy points,
    checkpoints)."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - self.started)
            if after_step is not None:
                after_step(state, model)

    return StepTimer()
