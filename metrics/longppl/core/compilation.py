"""Optional regional ``torch.compile`` of a model's repeated transformer blocks.

In eager mode a decoder layer runs many small element-wise kernels (float32 RMSNorm, rotary
embeddings, activations, residual adds); compiling the layer fuses them. All layers of a model share
one code object, so one compilation serves them all, and ``dynamic=True`` keeps new sequence
lengths from recompiling. Measured on an H200 with an 8B Llama shape (``scripts/bench/bench_longppl.py``):
-10% per 32k-token pass, -18% per batch of short windows, after a one-off 10-20 s compilation, so
it pays off on corpora, not on a single short text. Opt-in (``torch_compile=True``).
"""

from __future__ import annotations

import contextlib
import warnings

from torch import nn

from .logprobs import unwrap_model


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: modules whose class is listed in ``_no_split_modules``."""
    base = unwrap_model(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [module for module in base.modules() if type(module).__name__ in names]


@contextlib.contextmanager
def compiled_blocks(model: nn.Module, enabled: bool = True, backend: str = "inductor"):
    """Within the block, ``model``'s repeated blocks run compiled; on exit they run eagerly again.

    Args:
        enabled: ``False`` makes this a no-op (so callers need no branch).
        backend: ``torch.compile`` backend (tests use ``"eager"`` to check the plumbing quickly).
    """
    blocks = repeated_blocks(model) if enabled else []
    if enabled and not blocks:
        warnings.warn(
            f"torch_compile=True: {type(unwrap_model(model)).__name__} lists no repeated blocks "
            "(_no_split_modules); running it eagerly.",
            stacklevel=3,
        )
    already = [getattr(block, "_compiled_call_impl", None) is not None for block in blocks]
    for block, was_compiled in zip(blocks, already):
        if not was_compiled:  # leave blocks the user compiled alone
            block.compile(dynamic=True, backend=backend)
    try:
        yield model
    finally:
        for block, was_compiled in zip(blocks, already):
            if not was_compiled:
                block._compiled_call_impl = None
