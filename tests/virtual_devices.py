"""Virtual CUDA devices on a CPU-only machine, so that a test can fail when a tensor sits on the wrong one.

``VirtualDevices`` is a ``TorchFunctionMode``: every tensor operation under it passes through its
``__torch_function__``. It keeps each tensor's data on the CPU (so results are exactly the CPU
results) and gives the tensor a virtual device, ``cuda:<k>``, in an attribute. It then applies
PyTorch's own device rules to those virtual devices:

* ``tensor.device`` reports the virtual device, so code that reads devices (accelerate's hooks,
  ``.to(x.device)`` in the scoring core) sees what it would see on a multi-GPU machine;
* ``.to(...)``/``.cuda(...)``/``.cpu()``, ``copy_`` and a ``device=`` argument of a factory function
  move or create tensors there;
* any other operation whose tensor arguments (more than 0-d) sit on different devices raises the
  ``RuntimeError`` CUDA raises (``Expected all tensors to be on the same device``), except indexing
  with CPU indices and slice assignment (a copy), which PyTorch allows across devices (checked
  against two real GPUs: assignment through index tensors of a value on another GPU raises, slice
  assignment does not);
* ``.numpy()`` of a tensor on a virtual GPU raises, as it does for a real one.

So ``accelerate.dispatch_model`` with a ``device_map`` naming ``0``, ``1``, ``2`` runs unchanged (its
``AlignDevicesHook``s move weights and activations with ``.to``), and a computation that would mix
devices on real GPUs fails here too.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_TAG = "_virtual_cuda_index"  # the tensor's virtual CUDA index; absent: on the CPU


def index_of(tensor: torch.Tensor) -> int | None:
    """The virtual CUDA index of ``tensor`` (``None``: on the CPU)."""
    return getattr(tensor, _TAG, None)


def _parse(device) -> int | None | str:
    """A ``.to``/``device=`` argument -> a virtual CUDA index, ``None`` for the CPU, or ``"keep"``."""
    if isinstance(device, torch.Tensor):
        return index_of(device)
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, (str, torch.device)):
        parsed = torch.device(device)
        if parsed.type == "cpu":
            return None
        if parsed.type == "cuda":
            return parsed.index or 0
        raise RuntimeError(f"virtual devices: unsupported device {device!r}")
    return "keep"


def _tag(tensor: torch.Tensor, index: int | None) -> torch.Tensor:
    if index is None:
        if hasattr(tensor, _TAG):
            delattr(tensor, _TAG)
    else:
        setattr(tensor, _TAG, index)
    return tensor


_FREE = {  # functions that may see tensors of several devices
    torch.Tensor.copy_,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}
_DEVICE = torch.Tensor.device  # its getter reaches the mode as a fresh method-wrapper each time


class VirtualDevices(TorchFunctionMode):
    """See the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if getattr(func, "__self__", None) is _DEVICE:
            index = index_of(args[0])
            return torch.device("cpu") if index is None else torch.device("cuda", index)
        if func is torch.device and args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return torch.device("cuda", args[0])  # a bare index names the (here virtual) accelerator
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if name == "numpy" and index_of(args[0]) is not None:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")
        target = "keep"
        if "device" in kwargs:
            target = _parse(kwargs.pop("device"))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func not in _FREE:
            self._check(name, func, tensors, args)
        result = func(*args, **kwargs)
        if target == "keep":
            # outputs live where the inputs do (the indexed tensor for indexing); in-place results
            # keep their tag
            placed = [index_of(t) for t in tensors if t.dim() > 0 or index_of(t) is not None]
            target = placed[0] if placed else None
            if func is torch.Tensor.__getitem__:
                target = index_of(args[0])

        def place(value):
            if isinstance(value, torch.Tensor) and not any(value is t for t in tensors):
                _tag(value, target)
            return value

        return tree_map(place, result)

    @staticmethod
    def _check(name, func, tensors, args):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            base, indices = index_of(args[0]), [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
            # indices may be on the CPU or on the indexed tensor's device
            for index in indices:
                if index_of(index) not in (None, base):
                    raise RuntimeError(
                        "indices should be either on cpu or on the same device as the indexed tensor "
                        f"(cuda:{base}), got cuda:{index_of(index)}"
                    )
            value = args[2] if func is torch.Tensor.__setitem__ else None
            # slice assignment copies from any device; assignment through index tensors (index_put_)
            # needs the values on the tensor's device (CPU values are let through)
            if indices and isinstance(value, torch.Tensor) and index_of(value) not in (None, base):
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"cuda:{base} and cuda:{index_of(value)} (in index_put_)"
                )
            return
        # 0-d CPU tensors combine with anything, as on CUDA
        devices = {index_of(t) for t in tensors if t.dim() > 0 or index_of(t) is not None}
        if len(devices) > 1:
            shown = sorted("cpu" if d is None else f"cuda:{d}" for d in devices)
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {shown} "
                f"(in {name or func})"
            )

    @staticmethod
    def _move(func, args, kwargs):
        tensor, rest = args[0], list(args[1:])
        if func is torch.Tensor.cpu:
            target = None
        elif func is torch.Tensor.cuda:
            target = _parse(rest.pop(0) if rest else kwargs.pop("device", 0))
            target = 0 if target is None else target
        else:
            target = _parse(kwargs.pop("device")) if "device" in kwargs else "keep"
            kept = []
            for value in rest:
                parsed = _parse(value)
                if parsed == "keep":
                    kept.append(value)
                else:
                    target = parsed
                    if isinstance(value, torch.Tensor):
                        kept.append(value.dtype)  # .to(other) also takes other's dtype
            rest = kept
        kwargs.pop("non_blocking", None)
        rest = [value for value in rest if not isinstance(value, bool)]  # non_blocking / copy flags
        moved = tensor.to(*rest, **kwargs) if (rest or kwargs) else tensor
        if target == "keep" or target == index_of(tensor):
            return _tag(moved, index_of(tensor)) if moved is not tensor else tensor
        if moved is tensor:
            moved = tensor.detach().clone()
            if isinstance(tensor, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
        return _tag(moved, target)
