"""Progress inside documents, and a way to stop scoring part-way (a deadline).

Scoring reports its steps at three levels:

* documents (the bars ``scoring`` always showed);
* forward passes of a group of segments: a bar over the short windows (or documents) when they add
  up to more than ``large_pass_tokens``, advanced once per forward pass by the segments it held;
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

Practical lengths (one document, one forward pass; float32 on CPU unless said otherwise).
Measured on this project's 2-core CPU test machine with the tests' tiny Llama (hidden 32,
2 layers, vocabulary 600, ``scripts/bench_progress_lengths.py``): see ``PRACTICAL_LENGTHS``.
Memory of a pass grows linearly with its length: attention runs through PyTorch's fused SDPA
kernels (flash on CPU and GPU when there is no padding), which never hold a ``[T, T]`` matrix,
the LM head is projected in chunks (``logits_chunk_bytes``), and inference mode keeps no
activations of earlier layers. So a pass costs about ``T x (hidden x ~10 + intermediate x 2)``
floats of activations plus the weights, and time grows as ``T x params`` (the weight matmuls) plus
``T^2 x hidden x layers`` (attention), the latter dominating past a few tens of thousands of
tokens. Estimated, not measured here: an 8B Llama evaluator in bfloat16 needs ~16 GB of weights
plus ~1.5 MB of activations per token (``hidden 4096 x ~10 + intermediate 14336 x 2`` x 2 bytes,
peak inside one layer), so ~200 GB... no: activations are freed layer by layer, so ~45 GB for a
128k-token pass fits one 80 GB GPU, and its attention at 128k tokens costs minutes on an H100,
not hours; on CPU the same pass is ~100x slower (days for 1M tokens). Prefer a GPU beyond ~32k
tokens, and on CPU a small model (<= 0.5B) and documents of a few tens of thousands of tokens.
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
        bar = tqdm(total=total, desc=self.desc, unit=self.unit, leave=leave,
                   disable=not (self.enabled and shown) or total == 0)
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
