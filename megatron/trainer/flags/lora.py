"""The LoRA options: train low-rank adapters on a frozen base instead of every parameter.

``--lora-rank R`` (> 0) turns LoRA on; ``--lora-checkpoint DIR`` (a PEFT adapter directory) turns it
on with the directory's rank, alpha and targets, which flags given beside it must not contradict
(``resolve_lora``). The scale is alpha / rank with alpha fixed (``DEFAULT_ALPHA``), or alpha /
sqrt(rank) with ``--lora-use-rslora``. The names come from the library (``megatron.rl.lora.config``, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron.rl.lora.config import (
    DEFAULT_ALPHA,
    DEFAULT_TARGETS,
    INITS,
    TARGET_NAMES,
    AdapterConfigError,
    read_adapter_config,
    target_projections,
)
from megatron.trainer.flags.option import COMMANDS, Section, option


@dataclass(frozen=True)
class LoRA(Section):
    """Low-rank adapters on megatron-core's linear layers (base frozen)."""

    title = "LoRA (low-rank adapters)"

    lora_rank: int = option(
        0,
        "Train rank-R adapters on the linear layers of --lora-target-modules and freeze every "
        "other weight (no gradients or optimizer state for them; the reference policy of the KL "
        "term is the base model, adapters off); 0 = full fine-tuning.",
        minimum=0,
        resume=True,
        common=True,
        spellings=("TRL: lora_r", "NeMo-RL: policy.megatron_cfg.peft.dim", "verl: lora_rank"),
        commands=COMMANDS,
    )
    lora_alpha: float = option(
        DEFAULT_ALPHA,
        "Scale the adapters' output by alpha / rank (alpha / sqrt(rank) with --lora-use-rslora). "
        "With alpha fixed, the first updates move the policy alike at every rank, so one "
        "learning rate serves every rank.",
        parse=float,
        resume=True,
        spellings=("TRL: lora_alpha", "NeMo-RL: policy.megatron_cfg.peft.alpha"),
        commands=COMMANDS,
    )
    lora_use_rslora: bool = option(
        False,
        "Scale the adapters' output by alpha / sqrt(rank) (rank-stabilized LoRA) instead of "
        "alpha / rank: an update then grows with sqrt(rank), so a higher rank needs a lower "
        "learning rate.",
        switch=True,
        resume=True,
        spellings=("TRL/PEFT: use_rslora", "NeMo-RL: policy.megatron_cfg.peft.use_rslora"),
        commands=COMMANDS,
    )
    lora_dropout: float = option(
        0.0,
        "Dropout on the adapters' input; only 0 is supported (RL post-training uses none).",
        spellings=("TRL: lora_dropout", "NeMo-RL: policy.megatron_cfg.peft.dropout"),
    )
    lora_target_modules: tuple[str, ...] = option(
        list(DEFAULT_TARGETS),
        "Layers that get adapters: megatron-core's linear_qkv, linear_proj, linear_fc1, "
        "linear_fc2, or the Hugging Face projections as aliases (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj; a fused layer's adapter is one low-rank pair per "
        "projection, as PEFT's), or all-linear.",
        parse=str,
        nargs="+",
        choices=TARGET_NAMES,
        resume=True,
        spellings=("TRL: lora_target_modules", "NeMo-RL: policy.megatron_cfg.peft.target_modules"),
        commands=COMMANDS,
    )
    lora_init: str = option(
        "kaiming",
        "Initial A (B starts at zero, so step 0 is the base model exactly): kaiming (uniform in "
        "+-1/sqrt(in features), PEFT's default) or gaussian (normal, std 1/rank).",
        choices=INITS,
    )
    lora_checkpoint: str | None = option(
        None,
        "Start from this PEFT adapter directory (adapter_config.json, "
        "adapter_model.safetensors): its rank, alpha and targets; serve and evaluate apply it "
        "to the model they load.",
        parse=str,
        common=True,
        commands=COMMANDS,
    )
    save_lora: str | None = option(
        None,
        "At the end of training, write the adapters here as a PEFT adapter directory that "
        "peft.PeftModel.from_pretrained loads onto the base Hugging Face model.",
        parse=str,
        common=True,
    )

    @property
    def enabled(self) -> bool:
        """Whether the run trains adapters (after ``resolve_lora``: ``lora_rank`` > 0)."""
        return self.lora_rank > 0

    def problems(self) -> list[str]:
        errors = []
        if self.lora_dropout != 0:
            errors.append(
                f"--lora-dropout {self.lora_dropout}: only 0 is supported (dropout on the "
                "adapters' input is not implemented; RL post-training runs without it)"
            )
        if self.lora_alpha <= 0:
            errors.append(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        return errors


def resolve_lora(lora: LoRA, explicit: frozenset[str], gated: bool) -> tuple[LoRA, list[str]]:
    """``lora`` with ``--lora-checkpoint``'s rank, alpha, scaling and targets (a flag given
    beside it that contradicts the directory is refused, naming both) and the targets spelled as projections (``target_projections``; ``gated``: the model's MLP is
    SwiGLU); the problems found. Options are off (no change) when neither ``--lora-rank`` nor
    ``--lora-checkpoint`` is given; LoRA options set to other values than their defaults then are
    refused."""
    errors: list[str] = []
    if lora.lora_checkpoint is not None:
        try:
            saved = read_adapter_config(lora.lora_checkpoint)
        except AdapterConfigError as err:
            return lora, [f"--lora-checkpoint: {err}"]
        given = {
            "lora_rank": (lora.lora_rank, saved.rank),
            "lora_alpha": (lora.lora_alpha, saved.alpha),
            "lora_use_rslora": (lora.lora_use_rslora, saved.rslora),
        }
        for name, (value, theirs) in given.items():
            if name in explicit and value != theirs:
                errors.append(
                    f"--{name.replace('_', '-')} {value} conflicts with --lora-checkpoint "
                    f"{lora.lora_checkpoint} (adapter_config.json gives {theirs}); drop the flag"
                )
        if "lora_target_modules" in explicit and (
            _projections(lora.lora_target_modules, True) != saved.targets
        ):
            errors.append(
                f"--lora-target-modules {' '.join(lora.lora_target_modules)} conflicts with "
                f"--lora-checkpoint {lora.lora_checkpoint} (adapter_config.json targets "
                f"{' '.join(saved.targets)}); drop the flag"
            )
        lora = replace(
            lora,
            lora_rank=saved.rank,
            lora_alpha=saved.alpha,
            lora_use_rslora=saved.rslora,
            lora_target_modules=saved.targets,
        )
    if not lora.enabled:
        defaults = LoRA()
        unused = [
            f"--{name.replace('_', '-')}"
            for name in (
                "lora_alpha",
                "lora_use_rslora",
                "lora_target_modules",
                "lora_init",
                "save_lora",
            )
            if getattr(lora, name) != getattr(defaults, name)
        ]
        if unused:
            errors.append(f"{', '.join(unused)} need --lora-rank > 0 (or --lora-checkpoint)")
        return lora, errors
    try:  # one spelling: the projections
        targets = target_projections(lora.lora_target_modules, gated)
    except ValueError as err:
        return lora, [*errors, f"--lora-target-modules: {err}"]
    return replace(lora, lora_target_modules=targets), errors


def _projections(names: tuple[str, ...], gated: bool) -> tuple[str, ...]:
    """``target_projections`` of flag values (already checked against the choices)."""
    try:
        return target_projections(names, gated)
    except ValueError:
        return ()
