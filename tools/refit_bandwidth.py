"""What moving a policy's weights costs on one machine, by the path a refit can take: seconds and
GB/s, measured on the whole weight set of a real shape (every tensor at its shape, bf16).

    python tools/refit_bandwidth.py --shape llama-3.2-1b [--repeats 3]

* ``device_copy``: every tensor copied into a second set on the device (a collocated refit at the
  training layout, ``CollocatedRefit`` with nothing to gather).
* ``device_to_host``, ``host_to_device``: every tensor into host memory (pinned on CUDA) and back
  (the non-collocated refit stages through the host on both sides).
* ``gloo_broadcast``: the host tensors from one process to a second over gloo (the transport of
  the non-collocated ``Bridge``: loopback TCP on one machine).
* ``cuda_ipc``: a second process on the same GPU copies the first's device tensors, opened
  through CUDA IPC handles, into its own (not run without CUDA). ``cuda_ipc_open_seconds`` is
  the one-time cost of opening the handles.

Each path's seconds are the median of ``--repeats`` (after one untimed warm-up); GB/s counts the
weight bytes once. Prints one JSON object (``tools/device_check.sh``'s part ``d`` and its
report read it). The non-collocated refit of the shape costs about device_to_host +
gloo_broadcast + host_to_device; a collocated one at the training layout, device_copy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def shapes_of(name: str) -> dict:
    """``tools/bench_cuda.py``'s ``SHAPES[name]`` (one table of real shapes for both tools)."""
    spec = importlib.util.spec_from_file_location("bench_cuda", ROOT / "tools" / "bench_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SHAPES[name]


def weight_shapes(shape: dict) -> list[tuple[int, ...]]:
    """Every weight of a Llama-style GPT of ``shape`` at TP=1 (SwiGLU, RMSNorm, grouped-query
    attention; the output layer tied unless ``untie``), in megatron-core's layout."""
    h, f, v = shape["hidden_size"], shape["ffn_hidden_size"], shape["vocab_size"]
    heads, groups = shape["num_attention_heads"], shape["num_query_groups"]
    qkv = (heads + 2 * groups) * (h // heads)
    layer = [(h,), (qkv, h), (h, h), (h,), (2 * f, h), (h, f)]
    if shape.get("qkv_bias"):
        layer.append((qkv,))
    out = [(v, h)] + layer * shape["num_layers"] + [(h,)]
    return out + ([(v, h)] if shape.get("untie") else [])


def timed(fn: Callable[[], None], repeats: int, cuda: bool) -> float:
    """The median seconds of ``fn`` over ``repeats`` runs after one untimed run."""
    seconds = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def copy_all(dest: list[torch.Tensor], src: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for d, s in zip(dest, src):
            d.copy_(s, non_blocking=True)

    return run


def worker(
    rank: int, shapes: list[tuple[int, ...]], repeats: int, store_dir: str, queue, out: str
) -> None:
    """Rank 0 owns the weights and measures the one-process paths; both ranks then run the gloo
    broadcast and, on CUDA, rank 1 copies rank 0's tensors through CUDA IPC."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    host = [torch.empty(s, dtype=dtype, pin_memory=cuda) for s in shapes]
    result: dict = {}
    if rank == 0:
        weights = [torch.randn(s, device=device).to(dtype) for s in shapes]
        second = [torch.empty_like(w) for w in weights]
        result["device_copy"] = timed(copy_all(second, weights), repeats, cuda)
        result["device_to_host"] = timed(copy_all(host, weights), repeats, cuda)
        result["host_to_device"] = timed(copy_all(second, host), repeats, cuda)
        del second

    def broadcast() -> None:
        for t in host:
            dist.broadcast(t, src=0)

    result["gloo_broadcast"] = timed(broadcast, repeats, False)
    if cuda:
        if rank == 0:
            queue.put(weights)  # torch.multiprocessing sends CUDA tensors as IPC handles
        else:
            start = time.perf_counter()
            theirs = queue.get()
            torch.cuda.synchronize()
            result["cuda_ipc_open_seconds"] = time.perf_counter() - start
            ours = [torch.empty_like(t) for t in theirs]
            result["cuda_ipc"] = timed(copy_all(ours, theirs), repeats, True)
            del theirs
        dist.barrier()  # rank 0 keeps its tensors until rank 1 is done with them
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(opts: argparse.Namespace) -> dict:
    """Run both processes; every path's seconds and GB/s."""
    shapes = weight_shapes(shapes_of(opts.shape))  # here: the workers import torch alone
    nbytes = sum(torch.Size(s).numel() for s in shapes) * 2  # bf16
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        mp.start_processes(
            worker,
            args=(shapes, opts.repeats, tmp, queue, tmp),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    seconds = {**ranks[1], **ranks[0]}
    seconds["gloo_broadcast"] = max(ranks[0]["gloo_broadcast"], ranks[1]["gloo_broadcast"])
    cuda = torch.cuda.is_available()
    paths = {
        name: {"seconds": s, "gb_per_s": nbytes / s / 1e9}
        for name, s in seconds.items()
        if name != "cuda_ipc_open_seconds"
    }
    return {
        "shape": opts.shape,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "parameters": nbytes // 2,
        "bytes": nbytes,
        "repeats": opts.repeats,
        "paths": paths,
        "cuda_ipc_open_seconds": seconds.get("cuda_ipc_open_seconds"),
        "non_collocated_refit_seconds": sum(
            paths[p]["seconds"] for p in ("device_to_host", "gloo_broadcast", "host_to_device")
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", help="A shape of tools/bench_cuda.py.")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per path (median).")
    opts = parser.parse_args(argv)
    if opts.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {opts.repeats}")
    print(json.dumps(measure(opts), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
