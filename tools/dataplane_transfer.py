#!/usr/bin/env python
"""Bytes moved and rank-0 time per step: the old pickle + broadcast of every batch against the
keyed data plane, side by side in one run (CPU, gloo, DP ranks as processes).

For each step the same synthetic batch of ``--prompts`` x ``--group-size`` rollouts goes to the
data-parallel ranks both ways, and each way ends with every rank holding its own training rows:

* broadcast (before the data plane): rank 0 pickles the whole ``RolloutBatch`` and broadcasts it
  (``broadcast_object_list``); every rank builds the whole ``TrainBatch`` and keeps its shard;
* keyed (``--rl-data-plane``): rank 0 writes each sample once (``publish_groups``), shares the
  metadata, and each rank fetches only its shard's keys (``shard_batch``); the partition is
  cleared at the end of the step.

Bytes moved: every byte that crosses from one process to another (for the broadcast, the object's
size and pickle to each other rank; for the keyed plane, what each rank received, plus for
TransferQueue what it sent to the storage). Rank-0 time: rank 0's wall time from holding the
batch to holding its own rows. The tool checks that both ways give every rank identical rows.

    python tools/dataplane_transfer.py                          # DP=2, in-process plane
    python tools/dataplane_transfer.py --backend transferqueue  # needs the transferqueue extra
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the test helpers: grpo_testing

from grpo_testing.batches import GRPO, build_train_batch  # noqa: E402

from megatron.rl.dataplane import BACKENDS, make_data_plane  # noqa: E402
from megatron.rl.dataplane.batches import TRAIN_PARTITION, publish_groups, shard_batch  # noqa: E402
from megatron.rl.grpo.batch import TrainBatch, batch_advantages  # noqa: E402
from megatron.rl.rollout.generator import RolloutBatch  # noqa: E402
from megatron.rl.wire import RolloutGroup, TokenRollout  # noqa: E402

PAD_ID = 0


def make_groups(args: argparse.Namespace, step: int) -> list[RolloutGroup]:
    """Random rollouts: a prompt of ``--prompt-tokens`` and 1/2 to 1 x ``--generated-tokens``
    generated tokens, with decoded text of ``--chars-per-token`` characters per token (the
    broadcast pickles the text too)."""
    rng = random.Random(args.seed * 1000 + step)
    groups = []
    for g in range(args.prompts):
        prompt = [rng.randrange(2, args.vocab) for _ in range(args.prompt_tokens)]
        rollouts = []
        for _ in range(args.group_size):
            n = rng.randint(max(1, args.generated_tokens // 2), args.generated_tokens)
            completion = [rng.randrange(2, args.vocab) for _ in range(n)]
            rollouts.append(
                TokenRollout(
                    env_id="synthetic",
                    problem_id=str(g),
                    prompt="p" * (args.chars_per_token * len(prompt)),
                    completion="c" * (args.chars_per_token * n),
                    reward=rng.random(),
                    tokens=prompt + completion,
                    generation_mask=[False] * len(prompt) + [True] * n,
                    logprobs=[-rng.uniform(0.1, 4.0) for _ in range(n)],
                    policy_versions=[step] * n,
                    submission_policy_version=step,
                    temperature=1.0,
                )
            )
        groups.append(RolloutGroup(batch_id=step, index_in_batch=g, rollouts=rollouts))
    return groups


def broadcast_step(groups, step: int, rank: int, world: int) -> tuple[TrainBatch, int]:
    """The old way: (this rank's rows, bytes moved by the broadcast)."""
    message = [RolloutBatch(step, groups, 0, 0) if rank == 0 else None]
    dist.broadcast_object_list(message, src=0)
    moved = 0
    if rank == 0:  # a size then the pickle, to each other rank
        moved = (world - 1) * (8 + len(pickle.dumps(message[0])))
    batch = build_train_batch(message[0].groups, PAD_ID)
    per_rank = batch.num_rows // world
    return batch.rows(rank * per_rank, (rank + 1) * per_rank, trim=False), moved


def keyed_step(plane, groups, step: int, rank: int, world: int) -> tuple[TrainBatch, int]:
    """The data plane: (this rank's rows, bytes this rank moved)."""
    before = plane.stats.bytes_moved
    if rank == 0:
        advantages = batch_advantages(groups, GRPO)
        meta = publish_groups(plane, groups, step, advantages=advantages)
    else:
        meta = None
    meta = plane.share(meta)
    rows = list(range(len(meta.keys)))
    per_rank = len(rows) // world
    shard = shard_batch(plane, meta, rows, rows[rank * per_rank : (rank + 1) * per_rank], PAD_ID)
    plane.clear(TRAIN_PARTITION)
    return shard, plane.stats.bytes_moved - before


def same_rows(a: TrainBatch, b: TrainBatch) -> bool:
    """Whether two batches hold the same rows (bitwise)."""
    names = ("input_ids", "target_ids", "loss_mask", "inference_logprobs", "advantages")
    return all(
        torch.equal(getattr(a, n), getattr(b, n)) for n in (*names, "temperature", "lengths")
    )


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    plane = make_data_plane(args.backend, rank, world, torch.device("cpu"))
    results = {"broadcast": [], "keyed": []}
    try:
        for step in range(args.warmup + args.steps):
            groups = make_groups(args, step) if rank == 0 else None
            timings = {}
            for way in ("broadcast", "keyed"):
                dist.barrier()
                start = time.perf_counter()
                if way == "broadcast":
                    rows, moved = broadcast_step(groups, step, rank, world)
                else:
                    rows, moved = keyed_step(plane, groups, step, rank, world)
                timings[way] = (time.perf_counter() - start, moved, rows)
            if not same_rows(timings["broadcast"][2], timings["keyed"][2]):
                raise SystemExit(f"rank {rank}, step {step}: the two ways gave different rows")
            for way, (seconds, moved, _) in timings.items():
                total = torch.tensor([moved], dtype=torch.long)
                dist.all_reduce(total)  # bytes over every rank
                if step >= args.warmup:
                    results[way].append((seconds, int(total)))
    finally:
        plane.close()
    if rank == 0:
        report(args, world, results)
    dist.destroy_process_group()


def report(args: argparse.Namespace, world: int, results: dict) -> None:
    rows = args.prompts * args.group_size
    print(
        f"DP={world}, {args.prompts} x {args.group_size} = {rows} rollouts per step, prompt "
        f"{args.prompt_tokens} + up to {args.generated_tokens} generated tokens, backend "
        f"{args.backend}; median of {args.steps} steps after {args.warmup} warm-up"
    )
    medians = {}
    for way, values in results.items():
        seconds = statistics.median(s for s, _ in values)
        moved = statistics.median(b for _, b in values)
        medians[way] = (seconds, moved)
        print(f"  {way:9s}  bytes moved {moved:>14,.0f}   rank-0 time {seconds * 1e3:9.2f} ms")
    (bs, bb), (ks, kb) = medians["broadcast"], medians["keyed"]
    print(f"  keyed / broadcast: bytes {kb / bb:.3f}, rank-0 time {ks / bs:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (processes)")
    p.add_argument("--backend", choices=BACKENDS, default="in-process", help="--rl-data-plane")
    p.add_argument("--prompts", type=int, default=32, help="groups per step")
    p.add_argument("--group-size", type=int, default=16, help="rollouts per group")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt")
    p.add_argument("--generated-tokens", type=int, default=768, help="most generated tokens")
    p.add_argument("--chars-per-token", type=int, default=4, help="decoded text per token")
    p.add_argument("--vocab", type=int, default=32000, help="token ids drawn below this")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=1, help="steps before measuring")
    p.add_argument("--seed", type=int, default=0, help="of the synthetic rollouts")
    args = p.parse_args()
    if (args.prompts * args.group_size) % args.dp:
        raise SystemExit("--prompts x --group-size must be a multiple of --dp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.dp, port, args), nprocs=args.dp, start_method="spawn")


if __name__ == "__main__":
    main()
