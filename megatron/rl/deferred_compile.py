"""megatron-core imported without paying for ``torch.compile`` up front.

megatron-core decorates its fused kernels with ``torch.compile`` while it imports
(``megatron.core.jit.jit_fuser``). Decorating is cheap to use but not to set up: it imports
TorchDynamo and Inductor: about 2 s of a 3.5 s ``import megatron.core`` on one CPU core
(``python tools/import_cost.py`` measures both side by side), in every rank of every launch and
every process of the test suite, whereas a function is compiled only when first called and the CPU
tier calls none of them.

``install()`` (run by ``megatron/rl/__init__.py`` and ``megatron/trainer/__init__.py``, so before
any module of ours imports megatron-core) watches for the first ``import megatron.core``. While that
import runs, ``torch.compile`` is :func:`deferred`: each decorated function is compiled by the real
``torch.compile``, with the same arguments, on its first call, and runs compiled from then on. The
real ``torch.compile`` is back in place as soon as the import ends; ``jit_fuser`` keeps the
deferring decorator for the modules megatron-core imports later. Nothing changes when megatron-core
was imported before ours (the watch is then never installed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

WATCHED = "megatron.core"


class CompileOnFirstCall:
    """``fn``, compiled by ``compile_fn(fn, **options)`` when first called; a method too (it binds
    to its instance as a function does: megatron-core's router decorates methods)."""

    def __init__(self, fn: Callable, compile_fn: Callable, options: dict[str, Any]):
        functools.update_wrapper(self, fn)
        self._fn, self._compile_fn, self._options = fn, compile_fn, options
        self._compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = self._compile_fn(self._fn, **self._options)
        return self._compiled(*args, **kwargs)

    def __get__(self, instance, owner=None):
        return self if instance is None else types.MethodType(self, instance)


def deferred(compile_fn: Callable) -> Callable:
    """A stand-in for ``compile_fn`` (``torch.compile``) that defers each compilation to the
    decorated function's first call; both ``@deferred`` and ``@deferred(**options)`` work."""

    def compile_later(model: Callable | None = None, **options):
        if model is None:
            return lambda fn: CompileOnFirstCall(fn, compile_fn, options)
        return CompileOnFirstCall(model, compile_fn, options)

    compile_later.__doc__ = compile_fn.__doc__
    return compile_later


@contextlib.contextmanager
def compile_deferred() -> Iterator[None]:
    """``torch.compile`` is :func:`deferred` inside the block, the real one again after it."""
    import torch

    real = torch.compile
    torch.compile = deferred(real)
    try:
        yield
    finally:
        torch.compile = real


class _WatchMegatronCore(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` once, through the other finders, and runs its import under
    :func:`compile_deferred`; then steps aside."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        uninstall()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_deferring_compile(module):
            with compile_deferred():
                exec_module(module)

        spec.loader.exec_module = exec_deferring_compile
        return spec


def install() -> None:
    """Watch for the first ``import megatron.core`` (nothing to do once it is imported)."""
    if WATCHED in sys.modules or any(isinstance(f, _WatchMegatronCore) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _WatchMegatronCore())


def uninstall() -> None:
    """Stop watching."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WatchMegatronCore)]
