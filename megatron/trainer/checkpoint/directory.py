"""The checkpoint directory protocol, shared by both tiers; each tier only writes and reads shards.

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/<shards>                  the tier's: model, optimizer, LR schedule, RNG,
                                                 and the run's scalar flags
    <dir>/iter_0000100/rollout_state.json        the rollout pipeline (rank 0)
    <dir>/iter_0000100/inflight_kv/rank_XXXXX.pt the KV cache of requests in flight, per rank

CPU tier shards: ``mp_rank_XX/model_optim_rng.pt`` per tensor-parallel rank (``torch.save``);
CUDA tier shards: megatron-core ``dist_checkpointing`` (torch_dist). See ``CheckpointShards``.

A checkpoint after ``iteration`` optimizer steps holds the policy version (= ``iteration``) and
everything the forced-lag contract needs to continue exactly: the caller passes the rollout
pipeline's ``PipelineState`` - the prompt cursor, the submitted batches and their policy
versions, the finished groups not yet trained on and, on the CPU tier, the engine's work in
flight as it is (partial generations, whose KV cache each rank saves in ``inflight_kv/``), so a
resumed run generates exactly what the run that was never saved generates. The CUDA tier's engine
cannot save its cache: there the caller drains the pipeline first (every submitted batch
finished), and a resume equals the run that drained at the same step. A resumed run must share
the options declared ``resume=True`` (``megatron/trainer/flags``) with the saved one.

Writes are atomic: every rank writes into ``iter_XXXXXXX.partial/``; after a barrier rank 0
renames it to ``iter_XXXXXXX/`` and only then replaces the tracker file. A crash at any point of a
save leaves the previous checkpoint, and the tracker pointing at it, untouched.

Reads fail in one way: a tracker, rollout state or shard that cannot be read (truncated, random
bytes, not this tier's) stops every rank with one message naming the flag, the file and the
iteration, and the newest older complete checkpoint with the ``--ckpt-step`` that loads it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError

from megatron.rl.rollout.generator import PipelineState
from megatron.trainer.checkpoint import inflight
from megatron.trainer.flags import run_file
from megatron.trainer.flags.run import RunConfig, resume_options
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import agree_on_error

TRACKER = "latest_checkpointed_iteration.txt"
ROLLOUT_STATE = "rollout_state.json"
ITERATION_DIR = re.compile(r"iter_(\d{7})")


@dataclass(frozen=True)
class Checkpoint:
    """What ``load_checkpoint`` restores besides the modules it loads into."""

    iteration: int
    """Optimizer steps done: the policy version, and the first step the resumed run trains."""
    pipeline: PipelineState | None
    """The rollout pipeline (global rank 0 only; ``None`` elsewhere)."""
    inflight_kv: dict[str, Any] | None = None
    """This rank's KV cache of the requests in flight (``inflight.py``), if the save had it."""


@dataclass(frozen=True)
class TrainState:
    """The objects a checkpoint saves and restores on every rank."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any


@dataclass(frozen=True)
class LoadOptions:
    """What a load restores besides the model weights (``--no-load-optim``, ``--no-load-rng``,
    ``--finetune``)."""

    optimizer: bool = True
    """The optimizer state and the LR schedule."""
    rng: bool = True
    """The RNG states."""
    resume: bool = True
    """Continue the saved run: its iteration, rollout pipeline and resume-flag check (False:
    ``--finetune``, a new run from the saved weights)."""

    @classmethod
    def of(cls, cfg: RunConfig) -> LoadOptions:
        """The options of the flags."""
        if cfg.checkpointing.finetune:
            return cls(optimizer=False, rng=False, resume=False)
        return cls(
            optimizer=not cfg.checkpointing.no_load_optim, rng=not cfg.checkpointing.no_load_rng
        )


class CheckpointShards(ABC):
    """How one tier writes and reads its part of an iteration directory (collective)."""

    @abstractmethod
    def write(self, directory: Path, iteration: int, state: TrainState, cfg: dict) -> None:
        """Write this rank's shards of ``state`` and the scalar flags ``cfg`` into
        ``directory`` (it exists)."""

    @abstractmethod
    def read(
        self,
        directory: Path,
        state: TrainState,
        check_args: Callable[[dict], None],
        options: LoadOptions = LoadOptions(),
    ) -> None:
        """Restore ``state`` (what ``options`` asks for) from ``directory``; call
        ``check_args(saved flags)`` before any module is modified. Raise ``SystemExit`` naming
        the directory when it is not this tier's checkpoint; any other exception is reported by
        the protocol as an unreadable shard."""

    @abstractmethod
    def read_model(self, directory: Path, model: torch.nn.Module, flag: str) -> None:
        """Load only the model weights of ``directory`` into ``model`` (``--ref-load``; the
        model may be wrapped); ``SystemExit`` naming ``flag`` when they do not fit it."""

    def path(self, directory: Path) -> Path:
        """What this rank reads in ``directory`` (named in errors; its existence marks a
        complete checkpoint). Default: the whole directory."""
        return directory


def iteration_dir(root: str | Path, iteration: int) -> Path:
    """``<root>/iter_XXXXXXX``."""
    return Path(root) / f"iter_{iteration:07d}"


def saved_args(cfg: RunConfig) -> dict[str, Any]:
    """The scalar options (by argparse dest, the architecture resolved), lists of scalars (as
    tuples: ``--lora-target-modules``) and derived values stored with a checkpoint; options set
    to None are left out."""
    scalar = (bool, int, float, str)
    return {
        k: v
        for k, v in cfg.flat().items()
        if isinstance(v, scalar) or (isinstance(v, tuple) and all(isinstance(x, scalar) for x in v))
    }


def resume_mismatches(saved: dict[str, Any], cfg: RunConfig) -> list[str]:
    """Each option declared ``resume=True`` that the resumed run changes, as ``--flag saved ->
    now``; a checkpoint saved before the option existed is taken to have had its default."""
    problems = []
    now_values = cfg.flat()
    for dest, flag, default in resume_options():
        before, now = saved.get(dest, default), now_values[dest]
        if before != now:
            problems.append(f"{flag} {before} -> {now}")
    return problems


def latest_iteration(root: str | Path, flag: str = "--load") -> int:
    """The iteration the tracker file of ``root`` points at (``flag`` names the option)."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise SystemExit(f"{flag} {root}: no {TRACKER} found")
    text = read_guarded(flag, root, None, tracker, tracker.read_text).strip()
    if not text.isdigit():
        raise SystemExit(
            f"{flag} {root}: {tracker} holds {text[:40]!r}, not an iteration number"
            + fallback_hint(root, None)
        )
    return int(text)


def complete_iterations(root: str | Path, shards: CheckpointShards | None = None) -> list[int]:
    """Iterations under ``root`` whose directory is finished (renamed from ``.partial``) and holds
    a valid rollout state (and this rank's shards, given ``shards``), oldest first."""
    found = []
    for child in Path(root).iterdir() if Path(root).is_dir() else ():
        match = ITERATION_DIR.fullmatch(child.name)
        if match is None or not child.is_dir():
            continue
        try:
            PipelineState.model_validate_json((child / ROLLOUT_STATE).read_text())
        except (OSError, ValueError):
            continue
        if shards is None or shards.path(child).exists():
            found.append(int(match.group(1)))
    return sorted(found)


def fallback_hint(root: str | Path, failed: int | None) -> str:
    """Where to resume instead: the newest complete checkpoint older than ``failed`` (any, for
    ``None``), with the ``--ckpt-step`` that loads it; or that there is none."""
    older = [i for i in complete_iterations(root) if failed is None or i < failed]
    which = "complete checkpoint" if failed is None else "older complete checkpoint"
    if not older:
        return f"; it holds no {which}"
    newest = older[-1]
    return (
        f"; the newest {which} is iteration {newest} ({iteration_dir(root, newest)}): add "
        f"--ckpt-step {newest} to resume from it"
    )


def read_guarded(
    flag: str, root: str | Path, iteration: int | None, path: Path, read: Callable[[], Any]
) -> Any:
    """``read()``, with any failure but ``SystemExit`` turned into one message naming ``flag``,
    the file and the iteration (and the checkpoint to fall back to)."""
    try:
        return read()
    except SystemExit:
        raise
    except Exception as exc:  # torch.load, pickle, zip, JSON, pydantic, OS errors alike
        if isinstance(exc, ValidationError):  # pydantic: the first error's type and message
            first = exc.errors()[0]
            reason = f"{first['type']}: {first['msg']}"
        else:
            reason = " ".join(str(exc).split()).split(". ", 1)[0]  # its first sentence
        reason = reason[:200] or type(exc).__name__
        which = f"iteration {iteration}" if iteration is not None else "the tracker"
        raise SystemExit(
            f"{flag} {root}: cannot read {which}: {path}: {type(exc).__name__}: {reason}"
            + fallback_hint(root, iteration)
        ) from None


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp_path)``, flush to disk, then rename over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: str,
    iteration: int,
    shards: CheckpointShards,
    state: TrainState,
    pipeline: PipelineState | None,
    cfg: RunConfig,
    ctx: ParallelContext,
    inflight_kv: tuple[dict, dict[str, int]] | None = None,
) -> None:
    """Write the state after ``iteration`` optimizer steps (collective).

    ``pipeline`` is the rollout state on global rank 0 (ignored elsewhere); ``inflight_kv`` this
    rank's KV cache slots of the requests in flight and their layout (``inflight.py``).
    """
    if ctx.is_main and pipeline is None:
        raise ValueError("rank 0 must pass the rollout pipeline state")
    final = iteration_dir(root, iteration)
    staging = final.with_name(final.name + ".partial")
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
        staging.mkdir(parents=True)
    _barrier()
    shards.write(staging, iteration, state, saved_args(cfg))
    if inflight_kv is not None:
        inflight.write_kv(staging, ctx.rank, *inflight_kv)
    if ctx.is_main:
        text = pipeline.model_dump_json()
        write_atomic(staging / ROLLOUT_STATE, lambda tmp: tmp.write_text(text))
        run_file.write(run_file.resolved(cfg), staging / run_file.RUN_CONFIG_FILE)
    _barrier()
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        write_atomic(Path(root) / TRACKER, lambda tmp: tmp.write_text(f"{iteration}\n"))
    _barrier()


def save_captured(
    root: str,
    iteration: int,
    shards: CheckpointShards,
    state: TrainState,
    capture: Callable[[], tuple[PipelineState | None, tuple | None]],
    cfg: RunConfig,
    ctx: ParallelContext,
) -> str:
    """``save_checkpoint`` of the rollout pipeline as ``capture()`` (``RolloutSource.
    checkpoint_state``) returns it (collective); the line that says what was saved and how long
    it took (``inflight.saved_line``)."""
    started = time.perf_counter()
    pipeline, kv = capture()
    captured = time.perf_counter()
    save_checkpoint(root, iteration, shards, state, pipeline, cfg, ctx, kv)
    seconds = (captured - started, time.perf_counter() - started)
    return inflight.saved_line(iteration, root, seconds, pipeline, kv)


def load_checkpoint(
    root: str,
    shards: CheckpointShards,
    state: TrainState,
    cfg: RunConfig,
    ctx: ParallelContext,
    options: LoadOptions = LoadOptions(),
    step: int | None = None,
) -> Checkpoint:
    """Restore the checkpoint of iteration ``step`` (``--ckpt-step``; default: the tracker's)
    under ``root`` (``--load``) into ``state`` (collective). With ``--finetune`` (``options``)
    only the weights are loaded and the run starts at iteration 0.

    A failure on any rank raises ``SystemExit`` with the first rank's message on every rank.
    """
    error, iteration, pipeline, kv = None, -1, None, None
    try:
        iteration = step if step is not None else latest_iteration(root)
        pipeline = _read(root, iteration, shards, state, cfg, ctx.is_main, options)
        if options.resume:
            kv = read_guarded(
                "--load",
                root,
                iteration,
                inflight.kv_file(iteration_dir(root, iteration), ctx.rank),
                lambda: inflight.read_kv(iteration_dir(root, iteration), ctx.rank),
            )
    except SystemExit as exc:
        error = str(exc.code)
    agreed = agree_on_error(error)
    if agreed is not None:
        raise SystemExit(agreed)  # the same message on every rank (rank 0 prints it)
    if not options.resume:
        return Checkpoint(0, None)
    return Checkpoint(iteration, pipeline, kv)


def _read(
    root: str,
    iteration: int,
    shards: CheckpointShards,
    state: TrainState,
    cfg: RunConfig,
    is_main: bool,
    options: LoadOptions,
) -> PipelineState | None:
    """Read the rollout state (rank 0; not with ``--finetune``) first, then this rank's shards."""
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        raise SystemExit(
            f"--load {root}: no checkpoint of iteration {iteration} ({directory} does not exist)"
            + fallback_hint(root, iteration)
        )

    def check_args(saved: dict) -> None:
        if not options.resume:
            return
        problems = resume_mismatches(saved, cfg)
        if problems:
            raise SystemExit(
                f"--load {root}: flags differ from the saved run: {', '.join(problems)}"
            )

    pipeline = None
    if is_main and options.resume:
        rollout_file = directory / ROLLOUT_STATE
        if not rollout_file.is_file():
            raise SystemExit(
                f"--load {root}: iteration {iteration} is missing {rollout_file}"
                + fallback_hint(root, iteration)
            )
        pipeline = read_guarded(
            "--load",
            root,
            iteration,
            rollout_file,
            lambda: PipelineState.model_validate_json(rollout_file.read_text()),
        )
    if not shards.path(directory).exists():
        raise SystemExit(
            f"--load {root}: iteration {iteration} is missing {shards.path(directory)}"
            + fallback_hint(root, iteration)
        )
    read_guarded(
        "--load",
        root,
        iteration,
        shards.path(directory),
        lambda: shards.read(directory, state, check_args, options),
    )
    return pipeline


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
