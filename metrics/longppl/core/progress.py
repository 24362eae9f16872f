"""Progress inside documents, and a way to stop scoring part-way (a deadline).

Scoring reports its steps at three levels:

* documents (the bars ``scoring`` always showed);
* short windows: a bar over the windows when they add up to more than ``large_pass_tokens``
  tokens, advanced as each forward pass (a batch of windows) finishes;
* inside one forward pass of more than ``large_pass_tokens`` tokens (rows x padded length): a bar
  over the model's decoder layers, advanced by forward hooks on the layers, then one over the
  chunks of the LM-head projection. Short texts get no extra bars.

The hooks only count: they return ``None``, so the model's outputs, and every score, are
bit-for-bit those of a run without progress. They count only calls from the thread that
registered them, so concurrent requests sharing a model (the Space) do not advance each other's
bars.

A ``callback(desc, done, total)`` is called after every step of every bar, shown or not (with a
callback, every forward pass reports its layers, however short). An exception it raises
propagates out of scoring at once (hooks removed, the model's mode restored): the Space raises
one past its deadline, so a request overruns its time limit by at most one step, i.e. one
decoder layer of the largest forward pass, one LM-head chunk, or one batch of a model without
``_no_split_modules`` (plus whatever runs between passes: tokenization, loading a model).

Practical lengths. A pass's memory grows linearly with its length: attention runs through
PyTorch's fused SDPA kernels (no ``[T, T]`` matrix), inference mode frees each layer's activations,
and the LM head projects ``logits_chunk_bytes`` (1 GiB) of float32 logits at a time (plus as much
again for their log-softmax). Its time grows faster: attention costs ``~T^2`` and dominates
beyond a few thousand tokens on CPU. The evaluator also reads about ``(K + d) / d`` times the
document in short windows (5x at K=4096, d=1024), but in windows of ``K + d`` tokens, so that part
grows only linearly.

Measured with ``scripts/bench/bench_long_pass.py`` (one long pass over random tokens, float32, one
thread of a shared 2-core CPU, ``OMP_NUM_THREADS=1``; memory = peak RSS growth over the loaded
model)::

    model (Llama shape)                     2k tokens       8k tokens      32k tokens      128k tokens
    tests' tiny: hidden 32, 2 layers,       -               -              35 s, 0.17 GiB  262 s, 0.71 GiB
      vocabulary 600
    SmolLM2-135M: hidden 576, 30 layers,    8.4 s, 0.76 GiB 63 s, 2.0 GiB  -               -
      vocabulary 49152

Estimated from these (``t ~ 2.9 ms * T + 0.59 us * T^2`` fits the 135M rows; memory ~2 GiB of
LM-head chunk plus a few tens of KB per token): a 135M model needs ~12 min and ~3 GiB for a 32k
pass and ~3 h for 128k on one CPU thread (a few times less on many cores), and a 2M-character
text (1.25M tokens) would take days: on CPU keep to small models (<= 0.5B) and documents of up
to ~8-16k tokens. On a GPU (measured, README, ``scripts/bench/bench_longppl.py`` on one H200: two
Llama-3.1-8B-shaped models in bfloat16) a whole LongPPL of a 128k-token document takes 43 s and
44.5 GiB at peak, 30 GiB of it weights. Extrapolating that (estimated, not run): ~1M tokens
would need ~100 GiB beside the weights (one layer's activations at a time, which sharding the
layers over GPUs does not split) and ~7-13 min per long pass, ~20-30 min per document: about
the limit of one 141 GiB H200.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from .compilation import repeated_blocks

#: A forward pass (or a group of windows) of more tokens than this gets bars inside it.
LARGE_PASS_TOKENS = 32768

#: ``callback(desc, done, total)``: ``done`` of ``total`` steps of the bar ``desc`` are finished.
ProgressCallback = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where scoring reports its steps: tqdm bars (``enabled``) and an optional ``callback``.

    ``desc`` and ``unit`` label the current level (see ``labelled``); ``large_pass_tokens`` is the
    size above which a group of segments or a forward pass gets a bar of its own (``None``: the
    module's ``LARGE_PASS_TOKENS``, read when scoring).
    """

    enabled: bool = True
    callback: ProgressCallback | None = None
    large_pass_tokens: int | None = None
    desc: str = "LongPPL"
    unit: str = "segment"

    @property
    def threshold(self) -> int:
        """Tokens above which a pass (or a group of segments) gets bars inside it."""
        return LARGE_PASS_TOKENS if self.large_pass_tokens is None else self.large_pass_tokens

    def labelled(self, desc: str, unit: str) -> "Progress":
        """The same reporter for a level named ``desc`` counting ``unit``s."""
        return dataclasses.replace(self, desc=desc, unit=unit)

    @contextlib.contextmanager
    def steps(self, total: int, shown: bool = True, leave: bool = True) -> Iterator[Callable[..., None]]:
        """A bar of ``total`` steps; yields ``advance(n=1)``. Hidden unless ``enabled and shown``."""
        bar = tqdm(
            total=total, desc=self.desc, unit=self.unit, leave=leave, disable=not (self.enabled and shown) or total == 0
        )
        done = 0

        def advance(n: int = 1) -> None:
            nonlocal done
            done += n
            bar.update(n)
            if self.callback is not None:
                self.callback(self.desc, done, total)

        try:
            yield advance
        finally:
            bar.close()

    @contextlib.contextmanager
    def forward_pass(self, model: nn.Module, n_tokens: int) -> Iterator[Callable[[int, int], None] | None]:
        """Report the decoder layers and LM-head chunks of one forward pass of ``n_tokens`` tokens.

        Yields ``on_head_chunk(done, total)`` for ``token_log_probs``, or ``None`` when nothing is
        to be reported (a short pass without a callback). Hooks are removed on exit, also on error.
        """
        large = n_tokens > self.threshold
        if not (large and self.enabled) and self.callback is None:
            yield None
            return
        layers = repeated_blocks(model)
        owner = threading.get_ident()
        with contextlib.ExitStack() as stack:
            inner = self.labelled(f"{self.desc}: pass of {n_tokens} tokens", "layer")
            advance_layer = stack.enter_context(inner.steps(len(layers), shown=large, leave=False))

            @torch.compiler.disable  # a compiled block calls it eagerly instead of tracing tqdm
            def count_layer(module, args, output) -> None:
                if threading.get_ident() == owner:
                    advance_layer()

            for layer in layers:
                stack.callback(layer.register_forward_hook(count_layer).remove)
            head_bar: list[Callable[..., None]] = []

            def on_head_chunk(done: int, total: int) -> None:
                if not head_bar:  # the chunk count is known only once the head is reached
                    chunks = self.labelled(f"{self.desc}: LM head", "chunk")
                    head_bar.append(stack.enter_context(chunks.steps(total, shown=large, leave=False)))
                head_bar[0]()

            yield on_head_chunk
