"""Run ``pretrain_grpo.py``'s training loop on the CUDA tier, emulated on the CPU.

    python tests/grpo_testing/emulated_cuda_train.py [--kv-cache-mode=MODE] [flags]

Flags are validated as on a CUDA machine (``--bf16``, ``--use-distributed-optimizer`` accepted).
torch.distributed starts on gloo with the CPU as the context's device; the loop then runs
``CUDATier`` (megatron-core DDP, ``get_megatron_optimizer``, ``get_forward_backward_func``, the
``DynamicInferenceEngine`` row runner with ``flash_reference`` attention) under
``grpo_testing.emulated_cuda``. One process per run: the emulation patches torch globally.

``--kv-cache-mode=MODE`` picks the KV-cache mode of megatron-core's engine between generation windows
(``DynamicEngineConfig.kv_cache_mode``): ``recompute`` (the default) suspends the engine and
re-prefills active requests under the new weights; ``persist`` and ``offload`` (megatron-core
0.17+) keep the keys and values, as the CPU tier's engine does, so only with them do runs with a
forced lag match the CPU tier.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from grpo_testing.emulated_cuda import emulate_cuda_on_cpu  # noqa: E402

emulate_cuda_on_cpu()

import functools  # noqa: E402

import megatron.trainer.grpo as grpo  # noqa: E402
import megatron.trainer.tiers.cuda as cuda_tier  # noqa: E402
from megatron.trainer.flags.parse import parse_args  # noqa: E402


def initialize_on_gloo(cfg):
    """``initialize_distributed`` as on a CPU machine (gloo, CPU device)."""
    torch.cuda.is_available = lambda: False
    try:
        return initialize_distributed(cfg)
    finally:
        torch.cuda.is_available = lambda: True


initialize_distributed = grpo.initialize_distributed
grpo.initialize_distributed = initialize_on_gloo
grpo.select_tier = cuda_tier.CUDATier

if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this file
    argv = sys.argv[1:]
    modes = [a.split("=", 1)[1] for a in argv if a.startswith("--kv-cache-mode=")]
    if modes:
        argv = [a for a in argv if not a.startswith("--kv-cache-mode=")]
        mode = modes[-1]
        from megatron.rl.inference.megatron_core import dynamic_engine  # the backend's provider

        dynamic_engine.DynamicEngineConfig = functools.partial(
            dynamic_engine.DynamicEngineConfig, kv_cache_mode=mode
        )
    grpo.train(parse_args(argv))
