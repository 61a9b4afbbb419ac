"""The C allocator of a process: which one (``--cpu-allocator``) and glibc's policy
(``--malloc-mmap-threshold-kib``).

jemalloc and tcmalloc, from the distribution's packages, replace the C library's ``malloc`` when
preloaded (``LD_PRELOAD``), as PyTorch's CPU performance guide suggests: they keep the blocks of
one size together and return freed pages on a schedule of their own. At the recipe's LoRA shape
both peak higher than glibc (benchmarks/results/allocator.md), so glibc is the default and bounding
glibc's heap (below) is what lowers the peak. A library can only be preloaded when a process
starts, so ``use_allocator``
runs the same command again, at once, with the library in ``LD_PRELOAD`` (``os.execve``: the same
process, so a launcher that watches it sees nothing change).

glibc's ``malloc`` serves a large block from its own memory mapping only while the block is above
its *mmap threshold*, and that threshold rises (up to 32 MiB) every time such a block is freed.
After the first training step every activation and gradient buffer therefore comes from the heap,
and a heap shrinks only from its top: blocks freed between steps, whose sizes change with the
rollouts' lengths, stay resident. Setting the threshold (``mallopt(M_MMAP_THRESHOLD)``) fixes it,
so blocks of at least that size are mapped on allocation and unmapped when freed: the process
holds what is live instead of its high-water mark, at the cost of the page faults that map the
blocks again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (``malloc.h``)."""


def set_mmap_threshold(kib: int) -> bool:
    """Serve allocations of at least ``kib`` KiB from their own mapping, returned to the OS when
    freed. True when the C library took it (glibc); False elsewhere (musl, macOS: nothing set)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, kib * 1024) == 1


LIBRARIES: dict[str, tuple[str, ...]] = {
    "jemalloc": ("jemalloc",),
    "tcmalloc": ("tcmalloc_minimal", "tcmalloc"),
}
"""Allocator -> the library names ``ctypes.util.find_library`` looks for, in order of
preference (Debian: ``libjemalloc2``, ``libtcmalloc-minimal4``)."""

AUTO_ORDER: tuple[str, ...] = ("jemalloc", "tcmalloc")
"""What ``auto`` uses: the first of these installed, else glibc."""

_MARK = "MEGATRON_GRPO_ALLOCATOR"
"""Set in the environment of the re-executed process: the allocator it was started for, so it
never starts itself again."""


def library_path(name: str) -> str | None:
    """The shared library of allocator ``name`` found on this system (a name the dynamic
    loader resolves), or None."""
    for lib in LIBRARIES[name]:
        found = ctypes.util.find_library(lib)
        if found:
            return found
    return None


def resolve(choice: str) -> str:
    """The allocator ``choice`` stands for here: ``auto`` -> the first of ``AUTO_ORDER``
    installed, else ``glibc``."""
    if choice != "auto":
        return choice
    return next((name for name in AUTO_ORDER if library_path(name)), "glibc")


def _is_allocator(filename: str) -> bool:
    """Whether a library's file name is one of ``LIBRARIES``' (``libjemalloc.so.2``, ...)."""
    return any(filename.startswith(f"lib{lib}.") for libs in LIBRARIES.values() for lib in libs)


def loaded() -> str:
    """The allocator this process runs on: a preloaded jemalloc or tcmalloc, else glibc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "glibc"
    for name, libs in LIBRARIES.items():
        if any(f"lib{lib}." in maps for lib in libs):
            return name
    return "glibc"


def use_allocator(choice: str, glibc_policy: bool = False) -> str | None:
    """Make this process run on allocator ``choice`` (``--cpu-allocator``; ``glibc_policy``:
    ``--malloc-mmap-threshold-kib`` is given, so ``auto`` means glibc): returns at once when it
    does (the name), else starts the same command again with the library preloaded, or without
    a preloaded one for ``glibc`` (does not return). None when it cannot: the library is not
    installed (an explicit choice), or the restarted process still does not run on it."""
    want = "glibc" if choice == "auto" and glibc_policy else resolve(choice)
    if loaded() == want:
        return want
    if os.environ.get(_MARK) == want or (want != "glibc" and library_path(want) is None):
        return None  # restarted already, or nothing to preload: run on what is there
    kept = [p for p in _preloaded() if not _is_allocator(Path(p).name)]  # the rest stays
    preload = kept if want == "glibc" else [library_path(want), *kept]
    env = {**os.environ, _MARK: want, "LD_PRELOAD": " ".join(preload)}
    if not env["LD_PRELOAD"]:
        del env["LD_PRELOAD"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    return None  # not reached


def start_on_chosen_allocator(argv: list[str] | None = None) -> None:
    """``use_allocator`` of ``argv``'s ``--cpu-allocator`` (the command line's, by default),
    decided from the parsed flags before the training libraries load, so a restart costs only
    an interpreter and the flags. A command line that does not parse is left to the caller's
    ``parse_args``, which reports it."""
    from megatron.trainer.errors import UsageError
    from megatron.trainer.flags.parse import parse_values

    try:
        values, _ = parse_values(argv)
    except UsageError:
        return
    use_allocator(values["cpu_allocator"], values["malloc_mmap_threshold_kib"] is not None)


def _preloaded() -> list[str]:
    """The libraries of this environment's ``LD_PRELOAD``."""
    return os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
