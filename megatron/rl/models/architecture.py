"""The shape and flavour of a GPT, independent of flags: ``GPTArchitecture``, and how to build it.

A ``GPTArchitecture`` says everything about a dense decoder-only transformer that changes its
weights or its math (field names follow Megatron-LM's flags: ``--num-query-groups``,
``--position-embedding-type``, ``--normalization``, ``--swiglu``, ...). Parallelism, dtypes and
fusions are *not* part of it: they are the tier's business and come as ``tier_overrides`` of
``transformer_config``.

The defaults are the project's toy model: learned absolute positions, LayerNorm (eps 1e-5), GELU
MLP, biases on every linear layer, multi-head attention, tied input/output embeddings. A Hugging
Face Llama/Qwen/Mistral checkpoint is RoPE + RMSNorm + SwiGLU without linear biases (Qwen2: QKV
bias only; Qwen3: per-head RMSNorm of queries and keys), usually with grouped-query attention
(``megatron.rl.models.hf.read_hf_config`` builds that architecture from ``config.json``).

``build_gpt_model`` builds megatron-core's ``GPTModel`` for learned absolute positions (exactly
what ``megatron/training/model_provider.py`` builds) and ``RoPEGPTModel``
(``megatron/rl/models/rope.py``) for RoPE, which applies the rotary embedding at the
``position_ids`` each row passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.rl.models.gpt_spec import gpt_layer_spec
from megatron.rl.models.moe import moe_layers_train_without_sequence_parallel, moe_mlp_spec
from megatron.rl.models.rms_norm import with_mixed_dtype_rms_norms
from megatron.rl.models.rope import RoPEGPTModel, RopeScaling

__all__ = [
    "GPTArchitecture",
    "RopeScaling",
    "build_gpt_model",
    "layer_spec",
    "transformer_config",
]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class GPTArchitecture:
    """A dense pre-norm GPT; the defaults are the project's toy model."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Query heads."""
    ffn_hidden_size: int
    """Width of the MLP (per branch with SwiGLU: the gate and the up projection each have it)."""
    vocab_size: int
    """Rows of the embedding table (and of the output layer): the padded vocabulary."""
    max_position_embeddings: int
    """Longest sequence (size of the learned position table; with RoPE only recorded)."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None: one per query head (MHA)."""
    kv_channels: int | None = None
    """Width of one attention head; None: ``hidden_size // num_attention_heads``."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a position table added to the embeddings) or ``rope``."""
    rotary_base: float = 10000
    """RoPE base period (Hugging Face ``rope_theta``)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that is rotated."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 frequency scaling of RoPE; None: plain RoPE."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every normalization (Hugging Face ``rms_norm_eps``)."""
    swiglu: bool = False
    """MLP ``silu(x W_gate) * (x W_up)`` instead of ``gelu(x W_1)``."""
    add_bias_linear: bool = True
    """Biases on all linear layers (QKV, attention output, both MLP projections)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection even without ``add_bias_linear`` (Qwen2)."""
    qk_layernorm: bool = False
    """Normalize each query and key head (over ``kv_channels``) before RoPE (Qwen3)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer weights instead of reusing the input embedding."""
    num_experts: int | None = None
    """Routed experts of every layer's MLP (mixture of experts); None: a dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Width of one expert's MLP; None: ``ffn_hidden_size``."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then top-k (weights summing to < 1: Qwen3-MoE without
    ``norm_topk_prob``); False: top-k of the logits, softmax over those k (Mixtral)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of a shared expert every token passes through; None: none."""

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Width of one routed expert's MLP (``moe_ffn_hidden_size`` resolved)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads (``num_query_groups`` resolved)."""
        return self.num_query_groups or self.num_attention_heads

    def validate(self, tensor_model_parallel_size: int = 1) -> None:
        """Raise ValueError naming the first inconsistent field (or the TP degree it violates)."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            _positive(name, getattr(self, name))
        _positive("vocab_size", self.vocab_size)
        _positive("max_position_embeddings", self.max_position_embeddings)
        if self.num_query_groups is not None:
            _positive("num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups:
                _fail(
                    "num_query_groups",
                    f"{self.num_query_groups} does not divide num_attention_heads="
                    f"{self.num_attention_heads}",
                )
        if self.kv_channels is not None:
            _positive("kv_channels", self.kv_channels)
        elif self.hidden_size % self.num_attention_heads:
            _fail(
                "kv_channels",
                f"None needs hidden_size={self.hidden_size} divisible by num_attention_heads="
                f"{self.num_attention_heads}",
            )
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            _fail(
                "position_embedding_type",
                f"{self.position_embedding_type!r} is not one of {POSITION_EMBEDDING_TYPES}",
            )
        if self.normalization not in NORMALIZATIONS:
            _fail("normalization", f"{self.normalization!r} is not one of {NORMALIZATIONS}")
        if not self.norm_epsilon > 0:
            _fail("norm_epsilon", f"must be > 0, got {self.norm_epsilon}")
        self._validate_rope()
        self._validate_moe()
        self._validate_parallel(tensor_model_parallel_size)

    def _validate_moe(self) -> None:
        if self.num_experts is None:
            return
        _positive("num_experts", self.num_experts)
        _positive("moe_router_topk", self.moe_router_topk)
        if self.moe_router_topk > self.num_experts:
            _fail("moe_router_topk", f"{self.moe_router_topk} > num_experts={self.num_experts}")
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            _fail("moe_router_pre_softmax", "top-1 routing needs the softmax before the top-k")
        if self.moe_ffn_hidden_size is not None:
            _positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if self.moe_shared_expert_intermediate_size is not None:
            _positive(
                "moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size
            )

    def validate_expert_parallel(self, expert_model_parallel_size: int) -> None:
        """Raise ValueError unless the experts split evenly over ``expert_model_parallel_size``."""
        _positive("expert_model_parallel_size", expert_model_parallel_size)
        if expert_model_parallel_size == 1:
            return
        if self.num_experts is None:
            _fail("num_experts", "None (a dense MLP) cannot be split over expert-parallel ranks")
        if self.num_experts % expert_model_parallel_size:
            _fail(
                "num_experts",
                f"{self.num_experts} is not divisible by expert_model_parallel_size="
                f"{expert_model_parallel_size}",
            )

    def _validate_rope(self) -> None:
        if not 0 < self.rotary_percent <= 1:
            _fail("rotary_percent", f"must be in (0, 1], got {self.rotary_percent}")
        if not self.rotary_base > 0:
            _fail("rotary_base", f"must be > 0, got {self.rotary_base}")
        if self.position_embedding_type == "rope" and int(self.head_dim * self.rotary_percent) % 2:
            _fail("rotary_percent", f"rotates an odd number of channels of {self.head_dim}")
        scaling = self.rope_scaling
        if scaling is None:
            return
        if self.position_embedding_type != "rope":
            _fail("rope_scaling", "needs position_embedding_type='rope'")
        if not scaling.factor > 0:
            _fail("rope_scaling", f"factor must be > 0, got {scaling.factor}")
        if not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
            _fail(
                "rope_scaling",
                f"needs 0 < low_freq_factor < high_freq_factor, got {scaling.low_freq_factor} "
                f"and {scaling.high_freq_factor}",
            )
        if not scaling.original_max_position_embeddings > 0:
            _fail("rope_scaling", "original_max_position_embeddings must be > 0")

    def _validate_parallel(self, tp: int) -> None:
        _positive("tensor_model_parallel_size", tp)
        for name, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.query_groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.vocab_size),
            *self._moe_widths(),
        ):
            if value % tp:
                _fail(name, f"{value} is not divisible by tensor_model_parallel_size={tp}")

    def _moe_widths(self) -> list[tuple[str, int]]:
        if self.num_experts is None:
            return []
        widths = [("moe_ffn_hidden_size", self.expert_ffn_hidden_size)]
        if self.moe_shared_expert_intermediate_size is not None:
            widths.append(
                ("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
            )
        return widths


def _fail(field: str, message: str) -> None:
    raise ValueError(f"GPTArchitecture.{field}: {message}")


def _positive(field: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        _fail(field, f"must be a positive integer, got {value!r}")


def transformer_config(arch: GPTArchitecture, **tier_overrides) -> TransformerConfig:
    """megatron-core's config of ``arch``; ``tier_overrides`` set parallelism, dtypes, fusions.

    The base settings are the CPU tier's (no dropout, float32, weights initialized on the CPU,
    no fused kernels), as in ``megatron/training/model_provider.py``.
    """
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=arch.swiglu,
        activation_func=F.silu if arch.swiglu else F.gelu,
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        cuda_graph_scope=[],  # megatron-core's value for "the whole layer" ("full" is deprecated)
    )
    if arch.num_experts is not None:
        fields.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_router_topk,
            moe_ffn_hidden_size=arch.expert_ffn_hidden_size,
            moe_router_pre_softmax=arch.moe_router_pre_softmax,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
            moe_token_dispatcher_type="allgather",  # the dispatcher that runs over gloo
            moe_router_load_balancing_type="none",  # the tier's training options set the aux loss
            moe_aux_loss_coeff=0.0,
        )
    fields.update(tier_overrides)
    return TransformerConfig(**fields)


_CONFIG_FIELDS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size",
    "query_groups": "num_query_groups",
    "head_dim": "kv_channels",
    "normalization": "normalization",
    "norm_epsilon": "layernorm_epsilon",
    "swiglu": "gated_linear_unit",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "qk_layernorm": "qk_layernorm",
    "num_experts": "num_moe_experts",
}


def layer_spec(
    arch: GPTArchitecture, backend: BackendSpecProvider, moe_grouped_gemm: bool = False
) -> ModuleSpec:
    """The transformer layer spec of ``arch`` (its normalization, QK norm, experts) from
    ``backend``; ``moe_grouped_gemm``: the backend's grouped GEMM for the experts."""
    moe = None
    if arch.num_experts is not None:
        moe = moe_mlp_spec(
            backend, arch.moe_shared_expert_intermediate_size is not None, moe_grouped_gemm
        )
    return gpt_layer_spec(
        backend, qk_layernorm=arch.qk_layernorm, normalization=arch.normalization, moe=moe
    )


def build_gpt_model(
    arch: GPTArchitecture,
    config: TransformerConfig,
    layer_spec: ModuleSpec,
    pre_process: bool = True,
    post_process: bool = True,
    pg_collection: ProcessGroupCollection | None = None,
) -> GPTModel:
    """This pipeline stage's part of the GPT ``arch`` (vocab-parallel logits).

    ``pg_collection``: the process groups its layers use (None: megatron-core's parallel state);
    an inference copy on its own tensor-parallel layout passes its own.

    ``config`` must come from ``transformer_config(arch, ...)``: a field that disagrees with
    ``arch`` is refused by name. Learned absolute positions build megatron-core's ``GPTModel``;
    RoPE builds ``RoPEGPTModel``, which honours per-row ``position_ids``. Mixture-of-experts
    layers train at TP > 1 without sequence parallelism (``moe.GatherMoELayer``). RMSNorms take
    bfloat16 input under autocast without torch's warning (``rms_norm.RMSNorm``).
    """
    arch.validate(config.tensor_model_parallel_size)
    for ours, theirs in _CONFIG_FIELDS.items():
        if getattr(arch, ours) != getattr(config, theirs):
            raise ValueError(
                f"TransformerConfig.{theirs}={getattr(config, theirs)!r} disagrees with "
                f"GPTArchitecture.{ours}={getattr(arch, ours)!r}"
            )
    kwargs = dict(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not arch.untie_embeddings_and_output_weights,
        position_embedding_type=arch.position_embedding_type,
        pg_collection=pg_collection,
    )
    if arch.position_embedding_type == "learned_absolute":
        model = GPTModel(**kwargs)
    else:
        model = RoPEGPTModel(
            **kwargs,
            rotary_base=arch.rotary_base,
            rotary_percent=arch.rotary_percent,
            llama3_scaling=arch.rope_scaling,
        )
    if not config.perform_initialization:
        mark_tensor_parallel_weights(model)
    return with_mixed_dtype_rms_norms(moe_layers_train_without_sequence_parallel(model))


def mark_tensor_parallel_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Tag the tensor-parallel weights of ``model`` as megatron-core's random init does
    (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``); returns ``model``.

    megatron-core sets these attributes only while initializing a weight
    (``perform_initialization``), so a model built without init for a checkpoint load would
    have TP shards that every gradient-norm computation takes for replicas (counted on TP rank 0
    only: a wrong norm and a wrong clip at TP > 1). Column-parallel weights and the vocabulary
    embedding are split along dim 0, row-parallel weights along dim 1.
    """
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
    return model
