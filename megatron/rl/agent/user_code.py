"""Running code written for other frameworks: loading a class by name, seeding its global RNGs.

* ``load_class("package.module:Class")`` or ``load_class("path/to/file.py:Class")`` (a path
  relative to the working directory): the class, or a ``ValueError`` naming what is missing;
  ``load_function`` the same for a function (any callable that is not a class).
* ``async with seeded(seed): ...`` runs the block with Python's ``random`` module (and numpy's
  global RNG, when numpy is imported) seeded from ``seed``, one block at a time per event loop
  (an asyncio lock held across the block's awaits), and restores both RNG states afterwards.
  Code that draws its randomness from those global RNGs is then a pure function of ``seed``,
  whatever runs concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import random
import sys
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def load_class(spec: str) -> type:
    """The class named by ``module:Class`` or ``file.py:Class``; ValueError if it cannot load."""
    cls = _load_attribute(spec, "Class")
    if not isinstance(cls, type):
        target, _, name = spec.rpartition(":")
        raise ValueError(f"{target!r} has no class {name!r}")
    return cls


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by ``module:function`` or ``file.py:function``; ValueError if it cannot
    load or is not callable."""
    fn = _load_attribute(spec, "function")
    if isinstance(fn, type) or not callable(fn):
        target, _, name = spec.rpartition(":")
        raise ValueError(f"{target!r} has no function {name!r}")
    return fn


def _load_attribute(spec: str, kind: str) -> Any:
    """The attribute ``name`` of the module or file ``target`` in ``target:name`` (None when the
    module has no such attribute)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{spec!r} is not 'package.module:{kind}' or 'path/to/file.py:{kind}'")
    try:
        if target.endswith(".py") or "/" in target:
            module = _load_file(Path(target))
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except Exception as exc:  # an ImportError, or anything the module's own code raised
        raise ValueError(f"cannot import {target!r}: {type(exc).__name__}: {exc}") from None
    return getattr(module, name, None)


def _load_file(path: Path) -> Any:
    """Import a Python file once per absolute path, under a module name of its own."""
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"no such file {str(path)!r}")
    digest = hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    name = f"_megatron_rl_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before executing it: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@contextlib.asynccontextmanager
async def seeded(seed: int) -> AsyncIterator[None]:
    """Run the block alone (per event loop) with ``random`` and numpy's global RNG seeded."""
    loop = asyncio.get_running_loop()
    lock = _locks.get(loop)
    if lock is None:
        lock = _locks[loop] = asyncio.Lock()
    async with lock:
        python_state = random.getstate()
        numpy = sys.modules.get("numpy")  # seeded only if something imported it
        numpy_state = numpy.random.get_state() if numpy is not None else None
        random.seed(seed)
        if numpy is not None:
            numpy.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy_state is not None:
                numpy.random.set_state(numpy_state)


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, awaited if it returns an awaitable (async and plain methods alike)."""
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def positional_parameters(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` accepts (a large number for ``*args``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 1 << 16
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
