"""Hugging Face counterparts of the trainer's tiny model and tokenizer, for the comparisons.

``gpt2_like(...)`` is a randomly initialized ``GPT2LMHeadModel`` with the architecture of the
trainer's megatron-core ``GPTModel`` (pre-norm layers, learned absolute positions, GELU MLP,
tied embeddings, biases, same layers/width/heads/MLP width/padded vocabulary/positions), so both
have the same parameter count. ``char_tokenizer()`` is a ``PreTrainedTokenizerFast`` with the
ids of ``megatron.rl.tokenizer.CharTokenizer`` (0 PAD, 1 EOS, then the alphabet); the rest of
the padded vocabulary are unused tokens that generation suppresses, as the trainer's engine
never samples padded ids.
"""

from __future__ import annotations

from megatron.rl.tokenizer import DEFAULT_ALPHABET, CharTokenizer


def padded_vocab(divisible_by: int = 128) -> int:
    """The trainer's embedding rows for ``CharTokenizer`` (``--make-vocab-size-divisible-by``)."""
    v = CharTokenizer().vocab_size
    return -(-v // divisible_by) * divisible_by


def gpt2_like(
    num_layers: int, hidden: int, heads: int, ffn: int, vocab: int, positions: int, seed: int
):
    """A random-init GPT-2 shaped like the trainer's model (fp32, no dropout)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=hidden,
        n_layer=num_layers,
        n_head=heads,
        n_inner=ffn,
        activation_function="gelu",  # megatron-core's default MLP activation (exact GELU)
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=CharTokenizer.eos_id,
        eos_token_id=CharTokenizer.eos_id,
        pad_token_id=CharTokenizer.pad_id,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(config).float()


def char_tokenizer(vocab: int):
    """A fast tokenizer with ``CharTokenizer``'s ids, padded with unused tokens to ``vocab``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {"<pad>": CharTokenizer.pad_id, "<eos>": CharTokenizer.eos_id}
    ids.update({ch: i + 2 for i, ch in enumerate(DEFAULT_ALPHABET)})
    ids["<unk>"] = len(ids)
    while len(ids) < vocab:
        ids[f"<unused{len(ids)}>"] = len(ids)
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def unused_ids(vocab: int) -> list[int]:
    """Ids the trainer never samples: everything past ``CharTokenizer``'s vocabulary."""
    return list(range(CharTokenizer().vocab_size, vocab))
