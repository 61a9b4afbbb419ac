"""The ``megatron_core`` inference backend (``megatron.rl.inference.backends``): megatron-core's
``DynamicInferenceEngine`` on the trained model, for the CUDA tier.

* ``dynamic_engine.py``: the engine's construction on this rank's shard (seeded sampling,
  stepped on a detached loop) and ``build_dynamic_runner``, the backend's provider.
* ``dynamic_runner.py``: ``DynamicEngineRowRunner`` (``protocol.RowRunner``);
  ``seeded_sampler.py``: ``SeededSampler``, the trainer's sampling inside megatron-core's step.
* ``flash_reference.py``: a PyTorch reference of the flash-attn functions megatron-core's dynamic
  engine calls, installed where flash-attn is missing.

Nothing is imported here: importing this package does not import megatron-core's inference
engine; the registry imports the backend when a tier builds its runner.
"""
