"""Stable seed derivation: every RNG in a run descends from the run seed and a path of integers."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *path: int) -> int:
    """A 63-bit seed for ``path`` under ``seed``, identical across processes and Python versions.

    Example: ``derive_seed(seed, batch_id, index_in_batch, sample_index)`` seeds one request.
    Unlike ``hash()``, the result does not depend on PYTHONHASHSEED.
    """
    data = ",".join(str(int(v)) for v in (seed, *path)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
