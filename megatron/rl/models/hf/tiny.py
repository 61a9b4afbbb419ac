"""Tiny random Hugging Face checkpoints of each supported family, built locally (no download).

``make_tiny_checkpoint(family, out)`` trains a byte-level BPE tokenizer with ``tokenizers`` on a
built-in corpus of digit and arithmetic strings (or given text), builds a small random model of
the family with transformers and writes both with ``save_pretrained`` (safetensors): the files a
Hub checkpoint has (``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json``, a chat template). ``make_tiny_reward_model`` writes
a reward model (``AutoModelForSequenceClassification``) the same way.

Families (``TINY_FAMILIES``: the ``tiny`` recipes of every ``HFFamily`` entry, in the registry's
order; each family's module in ``families/`` declares its own), chosen to cover every mapping path
between them:

* ``llama``: Llama 2 style, multi-head attention, untied output layer, BOS added by the tokenizer;
* ``llama3``: grouped-query attention, ``rope_type: llama3`` scaling with non-default values
  (factor 4, low 1, high 8, original context 64), tied embeddings, rope_theta 500000;
* ``qwen2``: grouped-query attention, QKV bias, tied embeddings, rope_theta 1e6;
* ``qwen3``: QK norm, ``head_dim`` 32 != hidden/heads (16), untied;
* ``mistral``: grouped-query attention, ``sliding_window`` equal to ``max_position_embeddings``
  (accepted: it never masks).
* ``qwen3_moe``: Qwen3 attention, 4 experts of width 24, top 2, ``norm_topk_prob``;
* ``mixtral``: 4 experts, top 2, grouped-query attention.

Every parameter is random (weights and biases N(0, ``init_std``), norm weights 1 + N(0, 0.1)),
so a mapping mistake anywhere changes the logits. Token ids: 0 ``<|pad|>``, 1 ``<|bos|>``,
2 ``<|eos|>``, 3 ``<|end|>`` (end of a chat turn; a stop id in ``generation_config.json``),
then the role markers and the 256 byte symbols, then merges.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from megatron.rl.models.hf.families import HFFamily, TinyRecipe, families


def _recipes() -> dict[str, tuple[HFFamily, TinyRecipe]]:
    """Recipe name -> (its family, the recipe), in ``TINY_FAMILIES`` order."""
    return {recipe.name: (family, recipe) for family in families() for recipe in family.tiny}


def _recipe(family: str) -> tuple[HFFamily, TinyRecipe]:
    """The recipe named ``family``; ValueError naming the others if there is none."""
    recipes = _recipes()
    if family not in recipes:
        raise ValueError(f"unknown family {family!r}; choose from {tuple(recipes)}")
    return recipes[family]


TINY_FAMILIES = tuple(_recipes())
"""The tiny recipes' names: ``llama``, ``llama3``, ``qwen2``, ``qwen3``, ``mistral``,
``qwen3_moe``, ``mixtral``."""
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>"]
SPECIAL_TOKENS += ["<|assistant|>"]
CHAT_TEMPLATE = (
    "{% if add_bos %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def builtin_corpus() -> list[str]:
    """Deterministic digit/arithmetic lines (copy, add, multiply, compare)."""
    lines = []
    for a in range(0, 100, 3):
        for b in range(1, 60, 7):
            lines += [f"{a}+{b}={a + b}", f"{a}*{b}={a * b}", f"What is {a} - {b}? {a - b}."]
            lines.append(f"copy: {a}{b} -> {a}{b}, is {a} > {b}? {'yes' if a > b else 'no'}")
    return lines


def train_tokenizer(
    corpus: Iterable[str], vocab_size: int = 300, add_bos: bool = True, byte_level: bool = True
):
    """A BPE ``PreTrainedTokenizerFast`` with the special tokens and chat template: byte-level
    (the 256 byte symbols, as Llama 3 and Qwen), or, without ``byte_level``, over the characters
    of the corpus only (a small vocabulary: random-init models learn on it quickly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = list(corpus)
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<|pad|>"))
        tok.decoder = decoders.Fuse()
        alphabet = sorted({ch for line in corpus for ch in line})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if add_bos:
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos)]
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    wrapped.chat_template = CHAT_TEMPLATE.replace("add_bos", "true" if add_bos else "false")
    return wrapped


DEFAULT_MAX_POSITIONS = 4096
"""``max_position_embeddings`` of a tiny model: room for any ``--seq-length`` a CPU run uses (RoPE
has no position table, so it costs nothing)."""

SHAPES = {
    "qwen2.5-0.5b": dict(
        family="qwen2",
        hidden_size=896,
        num_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
    ),
}
"""Published model shapes (random weights here): ``make_tiny_checkpoint(**SHAPES[name], ...)``."""


def tiny_config(
    family: str,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
):
    """The transformers config of a tiny ``family`` model (or of a ``SHAPES`` entry): the common
    settings with the recipe's (``TinyRecipe.settings``), in the config class of its
    ``model_type``."""
    import transformers

    entry, recipe = _recipe(family)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings = {**common, **recipe.settings(common)}
    return transformers.AutoConfig.for_model(entry.model_types[0], **settings)


def randomize_(model: torch.nn.Module, seed: int, init_std: float = 0.05) -> None:
    """Every parameter random: norms 1 + N(0, 0.1), all other weights and biases N(0, init_std)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(init_std * noise)


def make_tiny_checkpoint(
    family: str,
    out: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int | None = None,
    tokenizer_vocab_size: int = 300,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
    **shape,
) -> Path:
    """Write a tiny random ``family`` checkpoint with its tokenizer to ``out``; returns ``out``.

    ``vocab_size``: embedding rows (default: the tokenizer's size rounded up to 16, so the
    embedding has rows no token uses, as in Qwen checkpoints).
    """
    import transformers

    _, recipe = _recipe(family)
    out = Path(out)
    tokenizer = train_tokenizer(
        builtin_corpus() if corpus is None else corpus, tokenizer_vocab_size, add_bos=recipe.add_bos
    )
    rows = vocab_size if vocab_size is not None else -(-len(tokenizer) // 16) * 16
    config = tiny_config(family, rows, hidden_size, num_layers, **shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_reward_model(
    out: str | Path,
    family: str = "llama3",
    num_labels: int = 1,
    hidden_size: int = 32,
    num_layers: int = 2,
    tokenizer_vocab_size: int = 300,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
) -> Path:
    """Write a tiny random reward model to ``out``: transformers'
    ``AutoModelForSequenceClassification`` of ``family`` with ``num_labels`` outputs (read at
    the last real token) and the family's tokenizer with its chat template; returns ``out``.
    For tests and CPU examples of ``agent_type: reward_model``: it scores, it knows nothing."""
    import transformers

    _, recipe = _recipe(family)
    out = Path(out)
    tokenizer = train_tokenizer(
        builtin_corpus() if corpus is None else corpus, tokenizer_vocab_size, add_bos=recipe.add_bos
    )
    config = tiny_config(family, -(-len(tokenizer) // 16) * 16, hidden_size, num_layers)
    config.num_labels = num_labels
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_(model, seed, init_std=0.2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
