"""Process-group and megatron-core ``parallel_state`` set-up, seeds and threads."""

from __future__ import annotations

import datetime
import os
import random
from typing import TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.rl.refit.bridge import Bridge
from megatron.trainer.errors import PeerFailed
from megatron.trainer.flags.refit import inference_run_config
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.flags.training import DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.allocator import set_mmap_threshold

T = TypeVar("T")


def initialize_distributed(cfg: RunConfig) -> ParallelContext:
    """Start torch.distributed (gloo on CPU, nccl on CUDA) and megatron-core's parallel state.

    Works under torchrun/SLURM (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) and as a
    plain ``python pretrain_grpo.py`` (a world of one, with no port at all).
    """
    cuda = torch.cuda.is_available()
    alone = "RANK" not in os.environ
    if alone:
        # One process, not started by a launcher: a world of its own on an in-process store. No
        # port: a MASTER_PORT inherited from a shell or a parent may name a port still held, and
        # a port picked here could be taken by another job before the store binds it.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        # the trainer's flag; tools and tests that start a world with fewer flags have no policy
        threshold = cfg.training.malloc_mmap_threshold_kib
        if threshold is not None:
            set_mmap_threshold(threshold)
    # validation fills the flag; tools that start a world from unvalidated flags get the default
    minutes = cfg.parallelism.distributed_timeout_minutes or DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES
    timeout = datetime.timedelta(minutes=minutes)
    generates_only, bridge = False, None
    if cfg.inference_ranks and not dist.is_initialized():  # --refit-mode non-collocated
        generates_only, bridge = _split_world(cfg, cuda, timeout)
        if generates_only:
            cfg = inference_run_config(cfg)
    if not dist.is_initialized():
        store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timeout, **store)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.parallelism.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallelism.pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.parallelism.expert_model_parallel_size,
    )
    set_seeds(cfg.training.seed, cuda)
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=device,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
        expert_model_group=parallel_state.get_expert_tensor_and_model_parallel_group(),
        generates_only=generates_only,
        bridge=bridge,
    )


def _split_world(
    cfg: RunConfig, cuda: bool, timeout: datetime.timedelta
) -> tuple[bool, Bridge | None]:
    """Start this process's side of a non-collocated job: the training ranks (the first
    ``cfg.world_size``) and the inference ranks (the last ``cfg.inference_ranks``) each get a
    default process group of their own on the launch's store, and training rank 0 and the
    inference ranks a ``Bridge``. Whether this process only generates, and its bridge."""
    store, rank, world = next(dist.rendezvous("env://"))
    if world != cfg.world_size + cfg.inference_ranks:
        raise RuntimeError(
            f"--refit-mode non-collocated: validated for {cfg.world_size} training + "
            f"{cfg.inference_ranks} inference ranks, launched with {world}"
        )
    store.set_timeout(timeout)
    generates_only = rank >= cfg.world_size
    side, side_rank, side_size = (
        ("inference", rank - cfg.world_size, cfg.inference_ranks)
        if generates_only
        else ("training", rank, cfg.world_size)
    )
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        store=dist.PrefixStore(side, store),
        rank=side_rank,
        world_size=side_size,
        timeout=timeout,
    )
    bridge = None
    if rank == 0 or generates_only:
        bridge_rank = side_rank + 1 if generates_only else 0
        first, last = cfg.world_size, cfg.world_size + cfg.inference_ranks - 1
        ranks = f"rank {first}" if first == last else f"ranks {first}..{last}"
        peers = "training rank 0" if generates_only else f"the inference {ranks}"
        bridge = Bridge(store, bridge_rank, cfg.inference_ranks + 1, timeout, peers)
    return generates_only, bridge


def set_seeds(seed: int, cuda: bool) -> None:
    """Same seed on every rank, so every parallel layout initializes identical weights."""
    random.seed(seed)
    torch.manual_seed(seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def agree_on_error(error: str | None) -> str | None:
    """The first failing rank's error message, on every rank (collective when distributed), so
    that every rank stops at the same point instead of waiting in a later collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def raise_agreed_failure(failure: BaseException | None) -> None:
    """Stop every rank at the same point (collective): raise this rank's ``failure``, else
    ``PeerFailed`` with the first failing rank's message, else return."""
    agreed = agree_on_error(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if agreed is not None:
        raise PeerFailed(agreed)


def main_rank_value(value: T) -> T:
    """Global rank 0's ``value`` on every rank (collective when distributed)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown_distributed() -> None:
    """Tear down megatron-core's groups and the default process group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
