"""Hugging Face Llama / Qwen2 / Qwen3 / Mistral checkpoints for megatron-core GPTModels.

* ``read_hf_config(dir)`` -> ``HFModelConfig`` (``.arch``: the ``GPTArchitecture``);
* ``load_hf_checkpoint(model, dir, hf)``: this TP rank's slices of the safetensors weights
  (``hf_weight_readers``: what reads each of them);
* ``gather_tensor_parallel_state_dicts(model)`` and ``export_hf(dir, arch, state_dicts, ...)``;
* ``load_hf_tokenizer(dir, hf)``: the tokenizer, checked against the embedding size.

Layouts and name mapping: ``mapping.py``; config fields: ``config.py``; what differs between
families: one ``HFFamily`` entry per module of ``families/`` (the registry ``families.families()``,
``family_of``). Errors: ``HFCheckpointError``.
"""

from megatron.rl.models.hf.checkpoint import (
    export_hf,
    gather_tensor_parallel_state_dicts,
    hf_weight_readers,
    load_hf_checkpoint,
    load_hf_tokenizer,
)
from megatron.rl.models.hf.config import FAMILIES, HFModelConfig, hf_config_dict, read_hf_config
from megatron.rl.models.hf.errors import HFCheckpointError
from megatron.rl.models.hf.families import HFFamily, family_of
from megatron.rl.models.hf.mapping import (
    hf_from_megatron,
    megatron_shard_from_hf,
    megatron_shard_readers,
)

__all__ = [
    "FAMILIES",
    "HFCheckpointError",
    "HFFamily",
    "HFModelConfig",
    "export_hf",
    "family_of",
    "gather_tensor_parallel_state_dicts",
    "hf_config_dict",
    "hf_from_megatron",
    "hf_weight_readers",
    "load_hf_checkpoint",
    "load_hf_tokenizer",
    "megatron_shard_from_hf",
    "megatron_shard_readers",
    "read_hf_config",
]
