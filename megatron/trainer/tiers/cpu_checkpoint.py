"""The CPU tier's checkpoint shards: one ``torch.save`` file per tensor-parallel rank.

``TorchShards`` writes ``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`` (model, optimizer, LR
schedule, RNG, flags) from data-parallel rank 0; with expert parallelism one per (TP, EP) rank,
``mp_rank_XX_YYY``, from expert-data-parallel rank 0. With LoRA a shard holds the adapters only,
with the fingerprint of the base they were trained on (``load_model_state`` checks it).
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable
from pathlib import Path

import torch

from megatron.rl.lora.model import (
    base_fingerprint,
    is_adapter_key,
    load_trainable_state_dict,
    lora_adapters,
    trainable_state_dict,
)
from megatron.trainer.checkpoint.directory import (
    CheckpointShards,
    LoadOptions,
    TrainState,
    write_atomic,
)
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.optimizer import load_optimizer_state


def load_model_state(model: torch.nn.Module, payload: dict, root: Path, flag: str) -> None:
    """A shard's model tensors into ``model``: the whole state dict, or with LoRA the adapters
    (their base must be the one they were trained on: ``lora_base``); a full model's shard
    into a LoRA model (``--finetune``) loads its weights as the base, the adapters as they
    start. ``SystemExit`` naming ``flag`` and ``root`` when the tensors do not fit."""
    saved = payload["model"]
    lora_saved = any(is_adapter_key(k) for k in saved)
    lora_model = lora_adapters(model) is not None
    try:
        if lora_saved and not lora_model:
            raise ValueError(
                "the checkpoint holds LoRA adapters only (a run with --lora-rank "
                f"{payload['cfg'].get('lora_rank')}): give the same LoRA flags and its base"
            )
        if lora_model and not lora_saved:  # a full model's weights as the frozen base
            missing, unexpected = model.load_state_dict(saved, strict=False)
            if unexpected or any(not is_adapter_key(k) for k in missing):
                raise ValueError(f"missing {missing[:4]}, unexpected {unexpected[:4]}")
            return
        if lora_model and payload.get("lora_base") != base_fingerprint(model):
            raise ValueError(
                "the adapters were trained on another base model (the base weights' fingerprint "
                f"{payload.get('lora_base')} differs from this run's {base_fingerprint(model)}): "
                "give the --hf-checkpoint (or --seed and model flags) of the run that saved them"
            )
        load_trainable_state_dict(model, saved)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"{flag} {root}: the weights do not fit this model: {exc}") from None


class TorchShards(CheckpointShards):
    """``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt``: one file per TP rank (DP rank 0 writes);
    with expert parallelism ``mp_rank_XX_YYY`` per (TP, EP) rank (expert-DP rank 0 writes: each
    holds its EP rank's experts, the rest as every rank has it)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def path(self, directory: Path) -> Path:
        """This rank's shard file in ``directory``."""
        name = f"mp_rank_{self.ctx.tp_rank:02d}"
        if self.ctx.ep_size > 1:
            name += f"_{self.ctx.ep_rank:03d}"
        return directory / name / "model_optim_rng.pt"

    def write(self, directory: Path, iteration: int, state: TrainState, cfg: dict) -> None:
        """``torch.save`` of the model, optimizer, schedule, RNG and flags (DP rank 0)."""
        ctx = self.ctx
        if (ctx.dp_rank if ctx.ep_size == 1 else ctx.expert_dp_rank) != 0:
            return
        path = self.path(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "iteration": iteration,
            "tensor_model_parallel_size": self.ctx.tp_size,
            "expert_model_parallel_size": self.ctx.ep_size,
            "model": trainable_state_dict(state.model),  # the adapters only, with LoRA
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": repr(random.getstate()),
            "cfg": cfg,
        }
        if lora_adapters(state.model) is not None:  # what names the base: its fingerprint
            payload["lora_base"] = base_fingerprint(state.model)
        write_atomic(path, lambda tmp: torch.save(payload, tmp))

    def read(
        self,
        directory: Path,
        state: TrainState,
        check_args: Callable[[dict], None],
        options: LoadOptions = LoadOptions(),
    ) -> None:
        """Load this rank's shard into the model and, as ``options`` say, the optimizer,
        schedule and RNG."""
        payload = self._load(directory, "--load")
        check_args(payload["cfg"])
        load_model_state(state.model, payload, directory.parent, "--load")
        if options.optimizer:
            load_optimizer_state(state.optimizer, payload["optimizer"])
            state.scheduler.load_state_dict(payload["scheduler"])
        if options.rng:
            torch.set_rng_state(payload["torch_rng"])
            random.setstate(ast.literal_eval(payload["python_rng"]))

    def read_model(self, directory: Path, model: torch.nn.Module, flag: str) -> None:
        """Load only the model weights of this rank's shard (``--ref-load``)."""
        payload = self._load(directory, flag)
        load_model_state(model, payload, directory.parent, flag)

    def _load(self, directory: Path, flag: str) -> dict:
        root, path = directory.parent, self.path(directory)
        if not path.is_file():
            raise SystemExit(f"{flag} {root}: missing {path}")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload["tensor_model_parallel_size"] != self.ctx.tp_size:
            raise SystemExit(
                f"{flag} {root}: saved with --tensor-model-parallel-size "
                f"{payload['tensor_model_parallel_size']}, this run uses {self.ctx.tp_size}"
            )
        saved_ep = payload.get("expert_model_parallel_size", 1)
        if saved_ep != self.ctx.ep_size:
            raise SystemExit(
                f"{flag} {root}: saved with --expert-model-parallel-size {saved_ep}, this run "
                f"uses {self.ctx.ep_size}"
            )
        return payload
