"""Point megatron-core's CUDA-only code paths at the CPU, for tests of the CUDA tier without a GPU.

megatron-core's dynamic inference context, ``DistributedDataParallel``, ``get_megatron_optimizer``
and pipeline schedules run plain PyTorch ops; what ties them to a GPU is a handful of calls:
allocations with ``device="cuda"`` or ``torch.cuda.current_device()``, ``Tensor.cuda()``, CUDA
events for timing, ``torch.cuda.synchronize``, the CUDA RNG state (saved by ``torch.compile``),
and assertions that tensors are on CUDA (inference's pipeline broadcasts, gradient clipping's
``type() == "torch.cuda.FloatTensor"``); megatron-core 0.19's controller also creates CUDA streams
for its asynchronous copies. ``emulate_cuda_on_cpu`` patches exactly those, process-wide, so the
CUDA tier's own code runs unchanged on a CPU-only torch.

On torch's CUDA build (the only build for some Pythons, e.g. torch 2.13 for CPython 3.12) two
more paths open that need a GPU: megatron-core's Triton kernel that appends to the KV cache
(taken whenever ``triton`` imports) and ``torch.compile`` of megatron-core's fused functions
(``jit_fuser``). The emulation turns both off: the KV cache is appended by megatron-core's
PyTorch path, and TorchDynamo is disabled (``TORCHDYNAMO_DISABLE=1`` for the process and its
children, set before megatron-core is imported), so nobody sets it by hand.

Only for a process of its own (a test's subprocess): the patches are global and irreversible.
It is a test of the wiring and the numerics of the CUDA tier, not of CUDA kernels: the ``gpu``
tests run the same code on a real device.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os

import torch

_FACTORIES = (
    "tensor",
    "zeros",
    "empty",
    "ones",
    "full",
    "arange",
    "zeros_like",
    "empty_like",
    "ones_like",
    "full_like",
    "randn",
    "rand",
)


class _Event:
    """CPU stand-in for ``torch.cuda.Event`` (megatron-core times engine steps with it)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0

    def wait(self, *args) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """CPU stand-in for ``torch.cuda.Stream`` (megatron-core 0.19 copies on side streams)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, int) and "cuda" in str(device)


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


def emulate_cuda_on_cpu() -> None:
    """Make megatron-core's CUDA allocations, transfers, timing and checks work on the CPU."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # before megatron-core decorates with torch.compile
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    plain_to, plain_type = torch.Tensor.to, torch.Tensor.type

    def to(self, *args, **kwargs):
        args = tuple(
            "cpu" if isinstance(a, (str, torch.device)) and _is_cuda(a) else a for a in args
        )
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return plain_to(self, *args, **kwargs)

    def tensor_type(self, *args, **kwargs):
        if args or kwargs:
            return plain_type(self, *args, **kwargs)
        return plain_type(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch.Tensor.record_stream = lambda self, *args, **kwargs: None
    torch.Tensor.type = tensor_type
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.is_available = lambda: True
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.Event = _Event
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.is_current_stream_capturing = lambda: False
    if hasattr(torch, "accelerator"):  # torch's optimizers check for graph capture on CUDA builds
        torch.accelerator.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.memory_stats = lambda *args, **kwargs: collections.defaultdict(int)
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    import megatron.core.inference.engines.dynamic_engine as engine_module

    engine_module.range_push = engine_module.range_pop = lambda *args, **kwargs: None
    import megatron.core.inference.communication_utils as communication

    communication._is_cuda = lambda tensor: None  # pipeline-stage broadcasts assert CUDA tensors
    import megatron.core.inference.contexts.dynamic_context as context_module

    context_module.triton_append_key_value_cache = None  # the PyTorch path, not Triton's kernel
