"""The key of a rollout's generation requests: shared by the inference protocol (``protocol.py``)
and the engine's checkpointed work (``engine_snapshot.py``), which the protocol's ``snapshot``
returns, so it lives below both."""

Key = tuple[int, int, int]
"""A rollout key: (batch_id, index_in_batch, sample_index)."""
