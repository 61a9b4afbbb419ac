"""Runs TRL's ``GRPOTrainer`` on the trainer's tiny model and digit task, or on a Hugging Face
checkpoint and the arithmetic task; used by the benchmarks and the recipe comparison.

    python tools/benchmarks/trl_worker.py --summary OUT.json [--steps 30 --prompts 8 ...]
    python tools/benchmarks/trl_worker.py --summary OUT.json --hf-checkpoint DIR \
        --task arithmetic --bf16 --lr 2e-5 --save-steps 10 --output-dir DIR

The model is ``hf_models.gpt2_like`` (random init, same shape and parameter count as the
trainer's default model) and the tokenizer has the trainer's character ids, or, with
``--hf-checkpoint DIR``, the checkpoint's own model and tokenizer; the prompts and the
reward are the digit-copy task's (``FixedBudgetDigits``: partial-credit positional match), and
the GRPO settings mirror ``pretrain_grpo.py``'s defaults: ``--prompts`` x ``--group-size``
completions per optimizer step (generated once, trained as micro-batches of
``--micro-batch-size``), ``--max-new-tokens`` per completion, temperature 1, no top-k/top-p, no
KL term (beta 0), clip 0.2/0.28, learning rate 3e-3, AdamW. The summary JSON records, at the end
of every optimizer step, the wall clock, the main thread's CPU time and run-queue wait
(``common.thread_clocks``), TRL's logged mean completion length and reward, and the process's
peak RSS.

``--task arithmetic``: the prompts and rewards of ``examples/rl/environment_configs/
arithmetic.yaml`` (``ArithmeticEnvironment``, chat messages rendered by TRL with the tokenizer's
chat template), the problem of group i of step s drawn exactly as ``pretrain_grpo.py`` draws it
(from the training partition of ``--val-split-fraction``, with the RNG seeded by ``derive_seed(
seed, s, i)``), in that order (TRL's dataset shuffling off). ``--bf16``: TRL's (Hugging Face
``Trainer``'s) bfloat16 mixed precision, float32 weights with autocast, as our CPU tier's
``--bf16``. ``--save-steps N``: a Hugging Face checkpoint every N steps in ``--output-dir``, for
evaluation with ``python -m megatron.trainer.evaluate`` (its time is left out of the step clocks:
the clock of a step ends before the save).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


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
    parser.add_argument("--lr-warmup-steps", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--task", choices=("copy", "arithmetic"), default="copy")
    parser.add_argument(
        "--env-config",
        default=str(REPO / "examples" / "rl" / "environment_configs" / "arithmetic.yaml"),
        help="--task arithmetic: the env config whose (single) arithmetic entry gives prompts, "
        "budget and reward.",
    )
    parser.add_argument("--val-split-fraction", type=float, default=0.1)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision.")
    parser.add_argument("--save-steps", type=int, default=0, help="Save every N steps (0: never).")
    parser.add_argument("--output-dir", default=None, help="Where --save-steps writes.")
    parser.add_argument(
        "--hf-checkpoint",
        default=None,
        help="Train this Hugging Face checkpoint with its tokenizer instead of the GPT-2 model.",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="Train PEFT LoRA adapters of this rank (GRPOTrainer's peft_config) on every linear "
        "layer of the transformer blocks (q, k, v, o, gate, up, down), base frozen; 0: full.",
    )
    parser.add_argument("--lora-alpha", type=float, default=None, help="Default: --lora-rank.")
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
            opts.num_layers,
            opts.hidden_size,
            opts.num_attention_heads,
            4 * opts.hidden_size,
            vocab,
            opts.seq_length,
            opts.seed,
        )
        tokenizer, suppressed = char_tokenizer(vocab), unused_ids(vocab)
    else:  # embedding rows past the tokenizer are never sampled (as in our engine)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(opts.hf_checkpoint, dtype=torch.float32)
        model.generation_config.eos_token_id = tokenizer_eos(opts.hf_checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(opts.hf_checkpoint)
        suppressed = list(range(len(tokenizer), model.config.vocab_size))
    if opts.task == "copy":
        env = FixedBudgetDigits("copy", DigitTaskArgs(task="copy"))
        problems = [
            env.make_problem(random.Random(derive_seed(opts.seed, i)))
            for i in range(opts.steps * opts.prompts)
        ]
        dataset = Dataset.from_dict(
            {"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]}
        )

        def reward(completions: list[str], answer: list[str], **_) -> list[float]:
            return [positional_match_reward(a, c) for c, a in zip(completions, answer)]

    else:
        env = arithmetic_environment(opts.env_config, opts.val_split_fraction)
        opts.max_new_tokens = env.args.max_tokens or opts.max_new_tokens
        problems = [  # group i of step s: what pretrain_grpo.py's generator asks for
            env.make_problem(random.Random(derive_seed(opts.seed, s, i)))
            for s in range(opts.steps)
            for i in range(opts.prompts)
        ]
        dataset = Dataset.from_dict(
            {
                "prompt": [[m.model_dump() for m in p.messages] for p in problems],
                "answer": [p.answer for p in problems],
            }
        )

        def reward(completions: list, answer: list[str], **_) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [
                arithmetic_reward(a, t, env.args.verify_timeout_s) for t, a in zip(texts, answer)
            ]

    rollouts = opts.prompts * opts.group_size
    if rollouts % opts.micro_batch_size:
        raise SystemExit("--prompts x --group-size must be divisible by --micro-batch-size")
    config = GRPOConfig(
        output_dir=opts.output_dir or str(Path(opts.summary).with_suffix(".trl_out")),
        use_cpu=True,
        bf16=opts.bf16,
        fp16=False,
        seed=opts.seed,
        max_steps=opts.steps,
        per_device_train_batch_size=opts.micro_batch_size,
        gradient_accumulation_steps=rollouts // opts.micro_batch_size,
        num_generations=opts.group_size,
        max_completion_length=opts.max_new_tokens,
        temperature=opts.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=opts.lr,
        lr_scheduler_type="constant_with_warmup" if opts.lr_warmup_steps else "constant",
        warmup_steps=opts.lr_warmup_steps,
        shuffle_dataset=False,  # the prompts in the order of the dataset (ours)
        max_grad_norm=1.0,
        generation_kwargs=generation_kwargs(suppressed, opts) or None,
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if opts.save_steps else "no",
        save_steps=opts.save_steps or 500,
        save_only_model=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    stamps: list[dict] = []
    lengths: list[float] = []
    rewards: list[float] = []
    saves: list[dict] = []
    began: list[float] = []

    class StepClock(TrainerCallback):
        """Clocks at the end of each optimizer step; TRL's mean completion length."""

        def on_train_begin(self, args, state, control, **kwargs):
            began.append(time.perf_counter() - start)

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append({"t": time.perf_counter() - start, **thread_clocks()})

        def on_save(self, args, state, control, **kwargs):
            saves.append({"step": state.global_step, "t": time.perf_counter() - start})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    peft_config = None
    if opts.lora_rank > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=opts.lora_rank,
            lora_alpha=opts.lora_alpha or opts.lora_rank,
            lora_dropout=0.0,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            task_type="CAUSAL_LM",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
        peft_config=peft_config,
    )
    trainer.train()
    Path(opts.summary).write_text(
        json.dumps(
            {
                "steps": stamps,
                "completion_tokens_mean": lengths,
                "reward_mean": rewards,
                "train_begin": began[0] if began else None,
                "saves": saves,
                "threads": torch.get_num_threads(),
                "wall_seconds": time.perf_counter() - start,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def arithmetic_environment(env_config: str, val_split_fraction: float):
    """The arithmetic environment of ``env_config`` (its one entry), with the held-out split of
    ``--val-split-fraction`` taken out of training as the trainer does."""
    from examples.rl.environments.arithmetic import ArithmeticEnvironment
    from megatron.rl.agent.env_config import load_env_config

    agent = load_env_config(env_config)
    entries = getattr(agent, "agents", [agent])
    envs = [a for a in entries if isinstance(a, ArithmeticEnvironment)]
    if len(envs) != 1:
        raise SystemExit(f"{env_config}: needs exactly one arithmetic entry, found {len(envs)}")
    if val_split_fraction > 0:
        envs[0].hold_out(val_split_fraction)
    return envs[0]


def arithmetic_reward(answer: str, completion: str, timeout_s: int) -> float:
    """The arithmetic environment's reward of a completion."""
    from examples.rl.environments.arithmetic.environment import arithmetic_reward as score

    return score(answer, completion, timeout_s)


def tokenizer_eos(directory: str) -> list[int]:
    """The stop ids our trainer uses for a checkpoint (EOS and ``generation_config.json``'s)."""
    from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(directory)
    return sorted({tok.eos_id, *getattr(tok, "extra_stop_ids", ())})


if __name__ == "__main__":
    main()
