"""The ``cpu`` inference backend (``megatron.rl.inference.backends``): the trained model with a
per-slot KV cache, for the CPU tier (it also runs on one GPU).

* ``kv_cache_runner.py``: ``KVCacheRowRunner`` (``protocol.RowRunner`` and
  ``SlotSnapshotRunner``), and ``build_kv_cache_runner``, the backend's provider.
* ``kv_cache.py``: ``KVCache``, every layer's keys and values per request slot, and
  ``KVCacheStep``, one forward pass's view of it (the model's core attention defers to it).
* ``cached_forward.py``: ``CachedForward``, the engine's forward as one plain-torch program over
  the model's own parameters; ``plain_layers.py``: which models it reproduces (``plain_layers``)
  and the modules of each layer it reads.

Nothing is imported here: the registry imports the backend when a tier builds its runner.
"""
