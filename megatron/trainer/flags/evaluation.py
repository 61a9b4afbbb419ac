"""The evaluation options: when to evaluate, held-out prompts, pass@k, the validation split and
the rollout dump."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.trainer.flags.megatron_lm import aliases_of
from megatron.trainer.flags.option import EVALUATE, Section, option


@dataclass(frozen=True)
class Evaluation(Section):
    """Evaluation on held-out prompts: greedy reward and sampled pass@k."""

    title = "evaluation"
    prefix = "eval-"

    interval: int | None = option(
        None,
        "Evaluate every N steps (after the update) on a held-out prompt set: greedy reward and "
        "pass@k, logged as eval/* (default: never).",
        parse=int,
        minimum=1,
        common=True,
    )
    prompts: int = option(
        32,
        "Held-out prompts per environment.",
        aliases=aliases_of("--eval-prompts"),
        minimum=1,
        commands=(EVALUATE,),
    )
    iters: int = option(
        0,
        "> 0 turns evaluation on (as in Megatron-LM): every --eval-interval iterations if set, "
        "and once after the last iteration; 0 = off unless --eval-interval is given.",
        minimum=0,
        megatron_lm_default=100,
    )
    samples: int = option(
        8,
        "n: sampled completions per held-out prompt for pass@k (at the training sampling "
        "parameters).",
        minimum=1,
        commands=(EVALUATE,),
    )
    pass_k: tuple[int, ...] = option(
        [1],
        "The k of the unbiased pass@k estimator to log (each <= --eval-samples).",
        parse=int,
        nargs="+",
        commands=(EVALUATE,),
    )
    correct_threshold: float = option(
        1.0,
        "A sampled completion counts as correct for pass@k when its reward is >= this.",
        commands=(EVALUATE,),
    )
    val_split_fraction: float = option(
        0.0,
        "Hold this share of each file-backed environment's problems (GSM8K, math JSONL) out of "
        "training as its validation partition: evaluation takes each held-out problem once (at "
        "most --eval-prompts), training never draws one. The split is fixed by the data set's "
        "size, not by --seed. 0 = off (the held-out set is drawn).",
        flag="--val-split-fraction",
        resume=True,
        commands=(EVALUATE,),
    )
    val_at_start: bool = option(
        False,
        "Evaluate before the first training step (logged as eval_at_start/* on the first step's "
        "record).",
        flag="--val-at-start",
        switch=True,
    )
    val_at_end: bool = option(
        False,
        "Evaluate after the last iteration (as --eval-iters > 0 does), whatever --eval-interval "
        "says.",
        flag="--val-at-end",
        switch=True,
    )
    val_dump_dir: str | None = option(
        None,
        "Write each evaluation's rollouts (prompt, response, reward, length, truncated) to "
        "<dir>/eval-v<policy version>.jsonl, one line per rollout of both passes.",
        flag="--val-dump-dir",
        parse=str,
        commands=(EVALUATE,),
    )

    @property
    def requested(self) -> bool:
        """Whether the run evaluates (``--eval-interval``, ``--eval-iters`` > 0,
        ``--val-at-start`` or ``--val-at-end``)."""
        return self.interval is not None or self.iters > 0 or self.val_at_start or self.val_at_end

    def problems(self) -> list[str]:
        errors = []
        bad_k = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad_k:
            errors.append(
                f"--eval-pass-k values must be in [1, --eval-samples ({self.samples})], got "
                f"{bad_k}"
            )
        if not 0.0 <= self.val_split_fraction < 1.0:
            errors.append(f"--val-split-fraction must be in [0, 1), got {self.val_split_fraction}")
        if self.val_split_fraction != 0.0 and not self.requested:
            errors.append(
                "--val-split-fraction holds problems out for evaluation: give --eval-interval, "
                "--eval-iters, --val-at-start or --val-at-end"
            )
        if self.val_dump_dir is not None and not self.requested:
            errors.append(
                "--val-dump-dir needs evaluation: give --eval-interval, --eval-iters, "
                "--val-at-start or --val-at-end"
            )
        return errors
