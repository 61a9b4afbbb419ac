"""The C allocator's policy of a CPU process (``--malloc-mmap-threshold-kib``).

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
