"""The checks of a collocated refit (``--rl-inference-tensor-model-parallel-size``,
``--refit-method``, declared with the parallel layout in ``training.py``) against the model, the
world and the tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.trainer.flags.run import RunConfig

FLAG = "--rl-inference-tensor-model-parallel-size"


def refit_problems(run: RunConfig, cuda: bool) -> list[str]:
    """What a collocated refit cannot do with the rest of the run, each naming its flags."""
    p = run.parallelism
    errors = []
    if p.refit_mode == "non-collocated":
        errors.append(
            "--refit-mode non-collocated (inference on ranks of its own) is not implemented: "
            "use --refit-mode collocated, where every rank keeps its shard of the inference copy"
        )
    if p.refit_method == "nccl" and not cuda:
        errors.append("--refit-method nccl needs CUDA: the CPU tier's ranks talk over gloo")
    t = p.rl_inference_tensor_model_parallel_size
    if t is None or t < 1:
        return errors
    if cuda:
        return errors + [
            f"{FLAG} is implemented on the CPU tier only: on CUDA the engine generates on the "
            "trained model's own layout (drop the flag)"
        ]
    if run.world_size % t != 0:
        errors.append(f"world size {run.world_size} must be divisible by {FLAG} ({t})")
    arch = run.architecture_flags
    groups = arch["num_query_groups"] or arch["num_attention_heads"]
    for what, value in (
        ("--num-attention-heads", arch["num_attention_heads"]),
        ("--num-query-groups", groups),
        ("--ffn-hidden-size", arch["ffn_hidden_size"]),
        ("--make-vocab-size-divisible-by", run.model.make_vocab_size_divisible_by),
    ):
        if value % t != 0:
            errors.append(f"{what} ({value}) must be divisible by {FLAG} ({t})")
    replicas = max(1, run.world_size // t)
    if run.inference.max_requests % replicas != 0:
        errors.append(
            f"--inference-max-requests ({run.inference.max_requests}) must be divisible by the "
            f"{replicas} inference replicas of {FLAG} {t}"
        )
    if arch["num_experts"] is not None:
        errors.append(f"{FLAG} supports dense models only: drop it or --num-experts")
    if run.lora.lora_rank > 0:
        errors.append(
            f"{FLAG} copies whole weights: with --lora-rank the engine generates with the "
            "adapters on the trained model itself (drop the flag)"
        )
    return errors
