"""``TransferQueueDataPlane`` on a local Ray: the in-process store's contract, on TransferQueue.

Skipped unless the ``transferqueue`` extra (transfer_queue, ray, tensordict) is installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("transfer_queue")

from megatron.rl.dataplane import DataPlaneError, make_data_plane  # noqa: E402
from megatron.rl.dataplane.store import FieldSpec  # noqa: E402

pytestmark = pytest.mark.transferqueue


@pytest.fixture(scope="module")
def plane():
    plane = make_data_plane("transferqueue", 0, 1, torch.device("cpu"))
    yield plane
    plane.close()


def samples(n: int) -> dict[str, list[torch.Tensor]]:
    """Rows of lengths 0, 1, 2, ...: every dtype the trainer writes, an empty row first."""
    g = torch.Generator().manual_seed(n)
    return {
        "tokens": [torch.randint(0, 50_000, (i,), generator=g) for i in range(n)],
        "mask": [torch.rand(i, generator=g) > 0.5 for i in range(n)],
        "logprobs": [torch.randn(i, generator=g) for i in range(n)],
        "temperature": [torch.tensor(0.5 + i, dtype=torch.float32) for i in range(n)],
        "reward": [torch.randn((), generator=g, dtype=torch.float64) for _ in range(n)],
    }


def test_samples_round_trip_bitwise_by_key_with_their_metadata(plane):
    keys = [f"5/{i}" for i in range(6)]
    fields = samples(6)
    plane.put("train", 5, keys, fields, tags={"length": range(6)}, attrs={"width": 5})
    meta = plane.meta("train")
    assert meta.keys == tuple(keys) and meta.step == 5 and meta.attrs == {"width": 5}
    assert meta.tags == {"length": (0, 1, 2, 3, 4, 5)}
    assert meta.fields["reward"] == FieldSpec(torch.float64, 0)
    assert meta.fields["mask"] == FieldSpec(torch.bool, 1)
    mine = ["5/4", "5/0", "5/3"]  # one rank's shard, in its own order
    got = plane.fetch("train", mine, list(fields))
    for name, values in fields.items():
        for key, value in zip(mine, got[name]):
            want = values[keys.index(key)]
            assert value.dtype == want.dtype and value.shape == want.shape
            assert torch.equal(value, want), (name, key)
    plane.clear("train")


def test_written_back_fields_are_read_back_and_cleared_with_the_partition(plane):
    import transfer_queue as tq

    keys = ["a", "b", "c"]
    plane.put("train", 0, keys, {"x": [torch.arange(3), torch.arange(1), torch.arange(2)]})
    plane.update("train", keys, {"advantages": [torch.tensor(v) for v in (0.5, -1.0, 0.0)]})
    plane.write("train", ["c", "a"], {"lp": [torch.full((2,), -2.0), torch.full((3,), -1.0)]})
    assert set(plane.meta("train").fields) == {"x", "advantages"}  # "b" has no "lp" yet
    got = plane.fetch("train", ["a", "c"], ["lp", "advantages"])
    assert got["lp"][0].tolist() == [-1.0] * 3 and got["lp"][1].tolist() == [-2.0] * 2
    assert [v.item() for v in got["advantages"]] == [0.5, 0.0]
    with pytest.raises(DataPlaneError, match="key 'b' has no field 'lp'"):
        plane.fetch("train", keys, ["lp"])
    plane.write("train", ["b"], {"lp": [torch.zeros(0)]})
    assert set(plane.meta("train").fields) == {"x", "advantages", "lp"}
    assert tq.kv_list(partition_id="train")["train"]["b"] == {"step": 0}
    plane.clear("train")
    assert tq.kv_list(partition_id="train") == {}
    with pytest.raises(DataPlaneError, match="no partition 'train'"):
        plane.fetch("train", keys, ["x"])


def test_missing_keys_fields_and_rewrites_are_refused_naming_them(plane):
    plane.put("val", 2, ["k0", "k1"], {"x": [torch.ones(2), torch.zeros(1)]})
    with pytest.raises(DataPlaneError, match="no key 'k9'"):
        plane.fetch("val", ["k0", "k9"], ["x"])
    with pytest.raises(DataPlaneError, match="key 'k1' has no field 'y'"):
        plane.fetch("val", ["k1"], ["y"])
    with pytest.raises(KeyError, match="already written"):
        plane.put("val", 2, ["k1"], {"x": [torch.ones(1)]})
    plane.write("val", ["k1"], {"y": [torch.tensor(1.0)]})
    with pytest.raises(DataPlaneError, match=r"field 'y' of keys \['k1'\] is already written"):
        plane.write("val", ["k1"], {"y": [torch.tensor(2.0)]})
    assert plane.fetch("val", ["k1"], ["y"])["y"][0].item() == 1.0  # the first value stays
    with pytest.raises(ValueError, match="holds step 2; clear it"):
        plane.put("val", 3, ["n0"], {"x": [torch.ones(1)]})
    plane.clear("val")
    plane.put("val", 3, ["n0"], {"x": [torch.ones(1)]})
    assert plane.meta("val").keys == ("n0",)
    plane.clear("val")
