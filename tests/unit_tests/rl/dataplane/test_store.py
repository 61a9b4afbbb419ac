"""``SampleStore``: keys, metadata, partitions, field writes and clearing."""

from __future__ import annotations

import pytest
import torch

from megatron.rl.dataplane.store import FieldSpec, SampleStore


def samples(n: int, start: int = 0) -> dict[str, list[torch.Tensor]]:
    """n samples: a 1-d int64 ``tokens`` of length i + 1 and a 0-d float32 ``reward``."""
    return {
        "tokens": [torch.arange(i + 1) + 10 * i for i in range(start, start + n)],
        "reward": [torch.tensor(float(i), dtype=torch.float32) for i in range(start, start + n)],
    }


def filled(n: int = 4, partition: str = "train", step: int = 3) -> SampleStore:
    store = SampleStore()
    keys = [f"k{i}" for i in range(n)]
    store.put(partition, step, keys, samples(n), tags={"length": range(1, n + 1)}, attrs={"w": 9})
    return store


def test_put_records_keys_fields_tags_attrs_and_step():
    meta = filled().meta("train")
    assert meta.partition == "train" and meta.step == 3
    assert meta.keys == ("k0", "k1", "k2", "k3")
    assert meta.fields == {
        "tokens": FieldSpec(torch.int64, 1),
        "reward": FieldSpec(torch.float32, 0),
    }
    assert meta.tags == {"length": (1, 2, 3, 4)}
    assert meta.tag("length").tolist() == [1, 2, 3, 4]
    assert meta.attrs == {"w": 9}


def test_get_returns_the_named_keys_and_fields_in_the_asked_order():
    store = filled()
    got = store.get("train", ["k3", "k0"], ["reward", "tokens"])
    assert list(got) == ["reward", "tokens"]
    assert [v.item() for v in got["reward"]] == [3.0, 0.0]
    assert [v.tolist() for v in got["tokens"]] == [[30, 31, 32, 33], [0]]


def test_missing_keys_fields_and_partitions_raise():
    store = filled()
    with pytest.raises(KeyError, match="no key 'k9'"):
        store.get("train", ["k0", "k9"], ["tokens"])
    with pytest.raises(KeyError, match="no field 'advantages'"):
        store.get("train", ["k0"], ["advantages"])
    with pytest.raises(KeyError, match="no partition 'val'"):
        store.get("val", ["k0"], ["tokens"])
    with pytest.raises(KeyError, match="no tag"):
        store.meta("train").tag("missing")


def test_each_sample_is_written_once():
    store = filled()
    with pytest.raises(KeyError, match="already written"):
        store.put("train", 3, ["k1"], {"tokens": [torch.arange(2)], "reward": [torch.tensor(0.0)]})
    with pytest.raises(ValueError, match="distinct"):
        store.put("train", 3, ["k7", "k7"], samples(2))


def test_more_samples_of_the_same_step_extend_the_partition():
    store = filled(2)
    store.put("train", 3, ["k2"], samples(1, start=2), tags={"length": [7]})
    meta = store.meta("train")
    assert meta.keys == ("k0", "k1", "k2") and meta.tags["length"] == (1, 2, 7)
    with pytest.raises(ValueError, match="need the tags"):
        store.put("train", 3, ["k3"], samples(1, start=3))


def test_a_partition_holds_one_step_until_cleared():
    store = filled()
    with pytest.raises(ValueError, match="holds step 3; clear it"):
        store.put("train", 4, ["n0"], samples(1))
    store.clear("train")
    assert store.partitions() == []
    store.put("train", 4, ["n0"], samples(1))
    assert store.meta("train").step == 4 and store.meta("train").keys == ("n0",)


def test_partitions_are_independent_namespaces():
    store = filled(partition="train")
    store.put("val", 0, ["k0"], {"x": [torch.ones(3)]})
    assert store.partitions() == ["train", "val"]
    assert store.meta("val").fields == {"x": FieldSpec(torch.float32, 1)}
    store.clear("val")
    assert store.partitions() == ["train"]
    assert store.get("train", ["k0"], ["tokens"])["tokens"][0].tolist() == [0]
    store.clear("val")  # clearing an absent partition is a no-op


def test_update_adds_a_field_which_the_metadata_lists_once_every_sample_has_it():
    store = filled()
    store.update("train", ["k0", "k1"], {"adv": [torch.tensor(0.5), torch.tensor(-0.5)]})
    assert "adv" not in store.meta("train").fields
    assert store.get("train", ["k1"], ["adv"])["adv"][0].item() == -0.5
    store.update("train", ["k3", "k2"], {"adv": [torch.tensor(1.0), torch.tensor(2.0)]})
    assert store.meta("train").fields["adv"] == FieldSpec(torch.float32, 0)
    assert [v.item() for v in store.get("train", ["k2", "k3"], ["adv"])["adv"]] == [2.0, 1.0]


def test_update_refuses_rewrites_unknown_keys_and_other_types():
    store = filled()
    store.update("train", ["k0"], {"adv": [torch.tensor(0.5)]})
    with pytest.raises(KeyError, match="already written"):
        store.update("train", ["k1", "k0"], {"adv": [torch.tensor(1.0), torch.tensor(1.0)]})
    with pytest.raises(KeyError, match="already written"):
        store.update("train", ["k1"], {"tokens": [torch.arange(3)]})
    with pytest.raises(KeyError, match="no keys"):
        store.update("train", ["nope"], {"adv": [torch.tensor(1.0)]})
    with pytest.raises(ValueError, match="is FieldSpec"):
        store.update("train", ["k1"], {"adv": [torch.tensor(1.0, dtype=torch.float64)]})
    assert "adv" not in store.get("train", ["k1"], ["tokens"])  # nothing half-written


def test_fields_must_have_one_dtype_and_rank_and_one_value_per_key():
    store = SampleStore()
    with pytest.raises(ValueError, match="mixes"):
        store.put("train", 0, ["a", "b"], {"x": [torch.ones(2), torch.ones(2, dtype=torch.int64)]})
    with pytest.raises(ValueError, match="2 values for 3 keys"):
        store.put("train", 0, ["a", "b", "c"], {"x": [torch.ones(2), torch.ones(2)]})
    with pytest.raises(ValueError, match="0-d or 1-d"):
        store.put("train", 0, ["a"], {"x": [torch.ones(2, 2)]})
    assert store.partitions() == []  # a refused put leaves nothing behind
