"""Write a tiny random Hugging Face checkpoint (model + locally trained BPE tokenizer).

    python tools/make_tiny_hf_checkpoint.py --family qwen3 --out /tmp/tiny-qwen3 \
        [--hidden-size 64] [--num-layers 2] [--vocab-size 320] [--tokenizer-corpus FILE] \
        [--max-position-embeddings 4096]
    python tools/make_tiny_hf_checkpoint.py --shape qwen2.5-0.5b --out /tmp/qwen2.5-0.5b-random
    python tools/make_tiny_hf_checkpoint.py --family llama3 --reward-model --out /tmp/tiny-rm \
        [--num-labels 1]      # an AutoModelForSequenceClassification (agent_type: reward_model)

No downloads: the tokenizer is trained with ``tokenizers`` on built-in digit/arithmetic strings
(or the lines of ``--tokenizer-corpus``), the model is random (``megatron/rl/models/hf/tiny.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.rl.models.hf.tiny import (  # noqa: E402
    DEFAULT_MAX_POSITIONS,
    SHAPES,
    TINY_FAMILIES,
    make_tiny_checkpoint,
    make_tiny_reward_model,
)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and write the checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=TINY_FAMILIES, default=None)
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="a published model's shape with random weights (sets the family and sizes)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="embedding rows (default: tokenizer size)"
    )
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="longest sequence the model takes, the largest --seq-length it trains with "
        f"(default: {DEFAULT_MAX_POSITIONS}; with --shape, the shape's)",
    )
    parser.add_argument("--tokenizer-vocab-size", type=int, default=300)
    parser.add_argument("--tokenizer-corpus", type=Path, default=None, help="text, one per line")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reward-model",
        action="store_true",
        help="write a reward model (AutoModelForSequenceClassification) instead of a causal LM",
    )
    parser.add_argument("--num-labels", type=int, default=1, help="outputs of --reward-model")
    args = parser.parse_args(argv)
    if (args.family is None) == (args.shape is None):
        parser.error("give exactly one of --family and --shape")
    if args.reward_model:
        if args.shape is not None:
            parser.error("--reward-model takes --family, not --shape")
        corpus = None
        if args.tokenizer_corpus is not None:
            corpus = [line for line in args.tokenizer_corpus.read_text().splitlines() if line]
        out = make_tiny_reward_model(
            args.out,
            args.family,
            args.num_labels,
            args.hidden_size,
            args.num_layers,
            args.tokenizer_vocab_size,
            corpus,
            args.seed,
        )
        print(f"wrote a random tiny {args.family} reward model to {out}")
        return
    shape = dict(SHAPES[args.shape]) if args.shape else {}
    family = shape.pop("family", args.family)
    corpus = None
    if args.tokenizer_corpus is not None:
        corpus = [line for line in args.tokenizer_corpus.read_text().splitlines() if line]
    sizes = dict(
        hidden_size=args.hidden_size, num_layers=args.num_layers, vocab_size=args.vocab_size
    )
    if args.max_position_embeddings is not None:
        shape["max_position_embeddings"] = args.max_position_embeddings
    out = make_tiny_checkpoint(
        family,
        args.out,
        **{**sizes, **shape},
        tokenizer_vocab_size=args.tokenizer_vocab_size,
        corpus=corpus,
        seed=args.seed,
    )
    print(f"wrote a random {args.shape or 'tiny ' + family} checkpoint to {out}")


if __name__ == "__main__":
    main()
