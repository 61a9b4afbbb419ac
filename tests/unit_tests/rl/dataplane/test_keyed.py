"""``KeyedDataPlane`` on 2-4 gloo ranks: each rank fetches exactly its rows, writes land in the
owner's store, failures reach every rank."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.distributed import run_on_ranks

from megatron.rl.dataplane.keyed import DataPlaneError, KeyedDataPlane

ROWS = 12
TOKENS = 500


def sample_fields(rows: range) -> dict[str, list[torch.Tensor]]:
    """Deterministic samples: row i has TOKENS + i tokens, a bool mask and a 0-d reward."""
    return {
        "tokens": [torch.arange(TOKENS + i) * (i + 1) for i in rows],
        "mask": [torch.arange(TOKENS + i) % (i + 2) == 0 for i in rows],
        "reward": [torch.tensor(i / 7, dtype=torch.float64) for i in rows],
    }


def shard_of(rank: int, world_size: int) -> list[int]:
    """Rows rank r asks for: a contiguous shard, the last two ranks sharing one (TP peers)."""
    replicas = world_size - 1 if world_size > 2 else world_size
    replica = min(rank, replicas - 1)
    per = ROWS // replicas
    return list(range(replica * per, (replica + 1) * per))


def fetch_and_write(rank: int, world_size: int) -> dict:
    plane = KeyedDataPlane(rank, world_size, torch.device("cpu"))
    keys = [f"7/{i}" for i in range(ROWS)]
    meta = None
    if plane.is_owner:
        plane.put(
            "train",
            7,
            keys,
            sample_fields(range(ROWS)),
            tags={"n": [TOKENS + i for i in range(ROWS)]},
        )
        meta = plane.meta("train")
    meta = plane.share(meta)
    shared_bytes = plane.stats.bytes_moved
    mine = shard_of(rank, world_size)
    got = plane.fetch("train", [meta.keys[i] for i in mine], ["tokens", "mask", "reward"])
    fetched_bytes = plane.stats.bytes_moved - shared_bytes
    written = {"logprobs": [-got["tokens"][j].float() / 3 for j in range(len(mine))]}
    writer = rank == 0 or rank < world_size - 1 or world_size == 2  # one TP peer writes
    plane.write("train", [meta.keys[i] for i in mine] if writer else [], written if writer else {})
    result = {"meta": meta, "rows": mine, "got": got, "fetched_bytes": fetched_bytes}
    if plane.is_owner:
        result["store"] = plane.store.get("train", keys, ["logprobs"])["logprobs"]
        result["fields"] = sorted(plane.meta("train").fields)
    plane.clear("train")
    if plane.is_owner:
        result["partitions_after_clear"] = plane.store.partitions()
    return result


@pytest.mark.parametrize(
    "world_size",
    [2, pytest.param(4, marks=pytest.mark.slow, id="4")],  # 4 spawned ranks: 30 s on 2 cores
)
def test_each_rank_fetches_exactly_its_rows_and_writes_back_fields(world_size):
    results = run_on_ranks(fetch_and_write, world_size)
    everything = sample_fields(range(ROWS))
    for rank, result in enumerate(results):
        assert result["meta"].keys == tuple(f"7/{i}" for i in range(ROWS))
        assert result["meta"].tags["n"] == tuple(TOKENS + i for i in range(ROWS))
        assert result["rows"] == shard_of(rank, world_size)
        for name, values in everything.items():
            want = [values[i] for i in result["rows"]]
            assert len(result["got"][name]) == len(want)
            for w, g in zip(want, result["got"][name]):
                assert g.dtype == w.dtype and torch.equal(g, w)
        payload = sum(v.numel() * v.element_size() for vs in result["got"].values() for v in vs)
        if rank == 0:  # the owner reads its own store and receives only the requests
            assert 0 < result["fetched_bytes"] <= 512 * (world_size - 1)
        else:  # its rows and a small header: nothing of the other ranks' rows
            assert payload <= result["fetched_bytes"] <= payload + 512
    owner = results[0]
    assert "logprobs" in owner["fields"]
    for i, value in enumerate(owner["store"]):
        assert torch.equal(value, -everything["tokens"][i].float() / 3)
    assert owner["partitions_after_clear"] == []


def bad_requests(rank: int, world_size: int) -> str:
    plane = KeyedDataPlane(rank, world_size, torch.device("cpu"))
    if plane.is_owner:
        plane.put("train", 0, ["a", "b"], {"x": [torch.ones(2), torch.zeros(3)]})
    keys = {0: ["a"], 1: ["a", "missing"], 2: ["b"]}[rank]
    try:
        got = plane.fetch("train", keys, ["x"])
        outcome = f"fetched {[v.tolist() for v in got['x']]}"
    except (DataPlaneError, KeyError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    try:  # rank 2 writes a field rank 0 already wrote
        fields = {"y": [torch.tensor(float(rank))]}
        plane.write("train", ["b"] if rank in (0, 2) else [], fields if rank in (0, 2) else {})
        if plane.is_owner:  # the owner stored rank 2's value before its own one
            outcome += " | wrote"
    except (DataPlaneError, KeyError) as exc:
        outcome += f" | {type(exc).__name__}: {exc}"
    return outcome


def test_a_request_the_owner_cannot_serve_fails_on_that_rank_and_the_owner_only():
    fetched, write = zip(
        *(o.split(" | ") if " | " in o else (o, "") for o in run_on_ranks(bad_requests, 3))
    )
    assert fetched[0].startswith("DataPlaneError: rank 1:") and "'missing'" in fetched[0]
    assert fetched[1] == fetched[0]  # the owner raises what it answered rank 1
    assert fetched[2] == "fetched [[0.0, 0.0, 0.0]]"  # served before the owner raised
    # rank 2's write of "y" to "b" lands first; the owner's own write of it is refused
    assert write[2] == "" and write[1] == ""
    assert write[0].startswith("KeyError") and "already written" in write[0]
