"""Run a function on N gloo ranks in fresh processes and collect each rank's return value.

The ranks meet through a file store in a temporary directory, not a TCP port: a port picked here
and bound later by rank 0 could be taken in between by another job on the machine (CI runs two
test suites side by side).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def env_without_world(**extra: str) -> dict[str, str]:
    """This process's environment without a torch.distributed world's variables, plus ``extra``:
    a process started with it is a world of its own (a test before may have set ``MASTER_PORT``
    to a port that is still held)."""
    return {**{k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}, **extra}


def _entry(rank: int, fn: Callable, world_size: int, out: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(out) / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), Path(out) / f"rank{rank}.pt")
    finally:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns their results.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    """
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _entry,
            args=(fn, world_size, out, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [
            torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]


def init_single_rank_world() -> None:
    """A gloo world of one process (for tests that need megatron-core's parallel state)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
