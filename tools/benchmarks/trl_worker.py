"""Runs TRL's ``GRPOTrainer`` on the trainer's tiny model and digit task; used by the benchmarks.

    python tools/benchmarks/trl_worker.py --summary OUT.json [--steps 30 --prompts 8 ...]

The model is ``hf_models.gpt2_like`` (random init, same shape and parameter count as the
trainer's default model) and the tokenizer has the trainer's character ids, or, with
``--hf-checkpoint DIR``, the checkpoint's own model and tokenizer; the prompts and the
reward are the digit-copy task's (``FixedBudgetDigits``: partial-credit positional match), and
the GRPO settings mirror ``pretrain_grpo.py``'s defaults: ``--prompts`` x ``--group-size``
completions per optimizer step (generated once, trained as micro-batches of
``--micro-batch-size``), ``--max-new-tokens`` per completion, temperature 1, no top-k/top-p, no
KL term (beta 0), clip 0.2/0.28, learning rate 3e-3, AdamW. The summary JSON records, at the end
of every optimizer step, the wall clock, the main thread's CPU time and run-queue wait
(``common.thread_clocks``), TRL's logged mean completion length, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def generation_kwargs(suppressed: list[int], opts: argparse.Namespace) -> dict:
    """``GRPOConfig.generation_kwargs``: ids never sampled, and the fixed length of
    ``--ignore-eos``."""
    kwargs: dict = {"suppress_tokens": suppressed} if suppressed else {}
    if opts.ignore_eos:
        kwargs["min_new_tokens"] = opts.max_new_tokens
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--summary", required=True, help="Write the summary JSON here.")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--hf-checkpoint",
        default=None,
        help="Train this Hugging Face checkpoint with its tokenizer instead of the GPT-2 model.",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Every completion is --max-new-tokens long (generate's min_new_tokens: EOS is not "
        "sampled before), as the trainer's --rl-ignore-eos gives.",
    )
    opts = parser.parse_args()

    start = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron.rl.environments.digits import DigitTaskArgs, positional_match_reward
    from megatron.rl.seeding import derive_seed
    from tools.benchmarks.common import thread_clocks
    from tools.benchmarks.envs import FixedBudgetDigits
    from tools.benchmarks.hf_models import (
        char_tokenizer,
        gpt2_like,
        padded_vocab,
        unused_ids,
    )

    if opts.hf_checkpoint is None:
        vocab = padded_vocab()
        model = gpt2_like(
            opts.num_layers, opts.hidden_size, opts.num_attention_heads, 4 * opts.hidden_size,
            vocab, opts.seq_length, opts.seed,
        )  # fmt: skip
        tokenizer, suppressed = char_tokenizer(vocab), unused_ids(vocab)
    else:  # embedding rows past the tokenizer are never sampled (as in our engine)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(opts.hf_checkpoint, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(opts.hf_checkpoint)
        suppressed = list(range(len(tokenizer), model.config.vocab_size))
    env = FixedBudgetDigits("copy", DigitTaskArgs(task="copy"))
    problems = [
        env.make_problem(random.Random(derive_seed(opts.seed, i)))
        for i in range(opts.steps * opts.prompts)
    ]
    dataset = Dataset.from_dict(
        {"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]}
    )

    def copy_reward(completions: list[str], answer: list[str], **_) -> list[float]:
        return [positional_match_reward(a, c) for c, a in zip(completions, answer)]

    rollouts = opts.prompts * opts.group_size
    if rollouts % opts.micro_batch_size:
        raise SystemExit("--prompts x --group-size must be divisible by --micro-batch-size")
    config = GRPOConfig(
        output_dir=str(Path(opts.summary).with_suffix(".trl_out")),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=opts.seed,
        max_steps=opts.steps,
        per_device_train_batch_size=opts.micro_batch_size,
        gradient_accumulation_steps=rollouts // opts.micro_batch_size,
        num_generations=opts.group_size,
        max_completion_length=opts.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        generation_kwargs=generation_kwargs(suppressed, opts) or None,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    stamps: list[dict] = []
    lengths: list[float] = []

    class StepClock(TrainerCallback):
        """Clocks at the end of each optimizer step; TRL's mean completion length."""

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append({"t": time.perf_counter() - start, **thread_clocks()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=copy_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    Path(opts.summary).write_text(
        json.dumps(
            {
                "steps": stamps,
                "completion_tokens_mean": lengths,
                "threads": torch.get_num_threads(),
                "wall_seconds": time.perf_counter() - start,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
