"""``KeyedCollection``: each data-parallel rank's rows, read by key from the data plane, are the
rows of the whole batch it trained on before; logprobs go back once per row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from grpo_testing.batches import GRPO, build_train_batch
from grpo_testing.rollouts import synthetic_groups

from megatron.rl.dataplane import KeyedDataPlane
from megatron.rl.dataplane.batches import LOGPROBS, TRAIN_PARTITION, publish_groups
from megatron.rl.grpo.batch import batch_advantages, padded_width
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.collection import Collection, KeyedCollection

TENSORS = ("input_ids", "target_ids", "loss_mask", "inference_logprobs", "advantages")


def dp_context(dp_rank: int, dp_size: int) -> ParallelContext:
    """Rank ``dp_rank`` of ``dp_size`` replicas (the plane runs in this one process)."""
    return ParallelContext(0, 1, torch.device("cpu"), 0, 1, dp_rank, dp_size, None, None)


def keyed(groups, dp_rank: int, dp_size: int, size: int, iterations: int) -> KeyedCollection:
    plane = KeyedDataPlane(0, 1, torch.device("cpu"))
    meta = publish_groups(plane, groups, step=7, advantages=batch_advantages(groups, GRPO))
    return KeyedCollection(plane, meta, size, iterations, dp_context(dp_rank, dp_size), pad_id=0)


def test_published_samples_carry_keys_tags_width_and_advantages():
    groups = synthetic_groups(3, 4, vocab=50, seed=3)
    plane = KeyedDataPlane(0, 1, torch.device("cpu"))
    meta = publish_groups(plane, groups, step=7, advantages=batch_advantages(groups, GRPO))
    batch = build_train_batch(groups, pad_id=0)
    assert meta.partition == TRAIN_PARTITION and meta.step == 7
    assert meta.keys == tuple(f"7/{i}" for i in range(12))
    assert meta.attrs == {"width": padded_width(groups)}
    assert list(meta.tags["length"]) == batch.lengths.tolist()
    assert list(meta.tags["loss_tokens"]) == batch.loss_mask.sum(1).int().tolist()
    got = plane.fetch(TRAIN_PARTITION, list(meta.keys), ["advantages"])["advantages"]
    assert torch.equal(torch.stack(got), batch_advantages(groups, GRPO))


@pytest.mark.parametrize(
    "groups, group_size, size, iterations, dp_size",
    [
        pytest.param(2, 4, 8, 1, 2, id="whole-collection-dp2"),
        pytest.param(4, 4, 8, 2, 2, id="two-global-batches-dp2"),
        pytest.param(3, 2, 4, 2, 2, id="wraps-around-dp2"),
        pytest.param(2, 4, 8, 1, 4, id="dp4"),
    ],
)
def test_each_rank_reads_exactly_its_rows_of_each_global_batch(
    groups, group_size, size, iterations, dp_size
):
    groups = synthetic_groups(groups, group_size, vocab=50, seed=5)
    whole = Collection(build_train_batch(groups, pad_id=0), size, iterations)
    per_rank = size // dp_size
    for dp_rank in range(dp_size):
        collection = keyed(groups, dp_rank, dp_size, size, iterations)
        assert collection.num_slices == whole.num_slices
        for j in range(iterations * whole.num_rows // size):
            want_global = whole.global_batch(j)
            want = want_global.rows(dp_rank * per_rank, (dp_rank + 1) * per_rank, trim=False)
            got = collection.global_batch(j)
            assert got.is_shard and got.num_rows == per_rank
            for name in (*TENSORS, "temperature", "lengths"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (j, name)
            assert got.global_loss_tokens == want_global.num_loss_tokens
            assert got.global_loss_sequences == want_global.num_loss_sequences
            assert got.global_trained_tokens == int(want_global.lengths.sum())


def test_logprobs_are_written_back_once_per_row_then_the_partition_is_cleared():
    """6 rows, global batches of 4 (rows 0-3, 4 5 0 1, 2-5), DP rank 0 of 2, micro-batches of 1:
    rank 0 writes rows 0 1 (first global batch) and 4 5 (second); 2 3 were rank 1's first."""
    groups = synthetic_groups(3, 2, vocab=50, seed=8)
    collection = keyed(groups, 0, 2, size=4, iterations=2)
    config = SimpleNamespace(needs_old_logprobs=True, needs_reference=False)
    for j in range(3):
        for m, cache in enumerate(collection.caches(j, 2)):
            shard = collection.global_batch(j).rows(m, m + 1)
            cache.old_logprobs = torch.full(shard.input_ids.shape, -float(10 * j + m))
        collection.write_back(j, config, micro_batch_size=1)
    store, meta = collection.plane.store, collection.meta
    written = [k for k in meta.keys if _has(store, k)]
    assert written == ["7/0", "7/1", "7/4", "7/5"]
    values = store.get(TRAIN_PARTITION, written, [LOGPROBS])[LOGPROBS]
    lengths = [meta.tags["length"][int(k.split("/")[1])] for k in written]
    assert [v.shape[0] for v in values] == lengths
    assert [set(v.tolist()) for v in values] == [{-0.0}, {-1.0}, {-10.0}, {-11.0}]
    collection.finish()
    assert store.partitions() == []


def _has(store, key: str) -> bool:
    try:
        store.get(TRAIN_PARTITION, [key], [LOGPROBS])
        return True
    except KeyError:
        return False


def test_masked_rows_leave_the_global_batches_sequence_count():
    """The per-sequence loss aggregations divide by the global batch's sequences with loss
    tokens: rows masked out of the loss (``mask_rows``) no longer count, on every rank."""
    groups = synthetic_groups(2, 4, vocab=50, seed=5)
    keep = torch.ones(8, dtype=torch.bool)
    keep[[1, 6]] = False
    for dp_rank in range(2):
        collection = keyed(groups, dp_rank, 2, size=8, iterations=1)
        assert collection.global_batch(0).global_loss_sequences == 8
        collection.mask_rows(keep)
        shard = collection.global_batch(0)
        assert shard.global_loss_sequences == 6 and shard.num_loss_sequences == 3
