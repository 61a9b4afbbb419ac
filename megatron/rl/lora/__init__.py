"""Low-rank adapters (LoRA) on megatron-core's linear layers, trained in place.

* ``config.py``: ``LoRAConfig`` and the target names (megatron-core's module names, Hugging Face's
  projection names as aliases), PEFT's ``adapter_config.json``; no torch, so the flags read it.
* ``adapter.py``: ``LinearAdapter``, the adapter of one tensor-parallel linear layer (one
  low-rank pair per projection it computes: q, k, v of the fused QKV; gate, up of the fused
  SwiGLU input), its initialization and its ``delta``.
* ``model.py``: ``apply_lora`` (freeze the base, attach the adapters, hook the layers),
  ``LoRAAdapters`` (the adapters of a model, on and off), merging, the adapters' state.
* ``peft.py``: PEFT adapter directories in and out (``adapter_config.json``,
  ``adapter_model.safetensors``), gathered over and scattered to tensor-parallel ranks.
"""
