"""The on-policy distillation options: a frozen teacher's per-token signal in the advantages.

``--distill-teacher DIR`` turns it on: every trained token's advantage gets the teacher term
``c * (log pi_teacher - log pi_old)`` (``megatron/rl/grpo/distill.py``), with ``c`` from
``--distill-coef`` (``only``: the teacher term alone, no environment reward in the advantage);
with ``--distill-topk-logits-k k`` the term is instead the reverse KL on the teacher's k most
likely ids, added to each token's loss. ``distill_problems`` checks the directory and its
tokenizer before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.trainer.flags.option import Section, option

if TYPE_CHECKING:
    from megatron.trainer.flags.grpo import GRPO
    from megatron.trainer.flags.model import Model

ONLY = "only"
"""``--distill-coef only``: the teacher term alone (prompts suffice; no reward is needed)."""
TRACKER = "latest_checkpointed_iteration.txt"
"""What marks a checkpoint directory of ours (``checkpoint/directory.py``)."""


def is_server_url(teacher: str) -> bool:
    """Whether ``--distill-teacher`` names a server (``http://`` or ``https://``), not a
    directory."""
    return teacher.startswith(("http://", "https://"))


def coef_value(text: str) -> str:
    """``--distill-coef``'s text: a number >= 0 or ``only`` (the check is ``problems``)."""
    return text.strip().lower()


@dataclass(frozen=True)
class Distillation(Section):
    """On-policy distillation: the student samples, a frozen teacher scores every sampled token."""

    title = "On-policy distillation"

    distill_teacher: str | None = option(
        None,
        "Distill from this frozen teacher: a Hugging Face model directory (config.json and "
        "safetensors; any architecture, the policy's tokenizer), a checkpoint directory of "
        "ours (--save's; the policy's architecture), or the base URL of a server that scores "
        "texts (POST /v1/completions with echo and logprobs, answering with the prompt's token "
        "ids, as ours does; its model must use the policy's tokenizer; each rollout is one "
        "request, sent in order; the job's key of --rl-api-key-file is sent). Its logprob of "
        "every trained token is computed where the reference logprobs are (the policy's TP/PP "
        "layout and precision), at temperature 1, and each token's advantage gets --distill-coef x (teacher logprob - "
        "student logprob before the collection's first update): the sampled-token reverse KL, "
        "discount 0. Read again on every start, also when resuming (as --ref-load).",
        parse=str,
        common=True,
        spellings=("NeMo-RL: teacher.model_name", "TRL: teacher_model_name_or_path"),
    )
    distill_coef: str = option(
        "1",
        "Weight of the teacher term in each token's advantage (A_env + c x (log pi_teacher - "
        "log pi_old)); 0 = plain RL (no teacher forward), 'only' = the teacher term alone "
        "(the environment's reward is not used: prompts alone suffice).",
        parse=coef_value,
        resume=True,
        common=True,
    )
    distill_topk_logits_k: int | None = option(
        None,
        "Top-k variant: instead of the sampled token's teacher term in the advantage, add "
        "--distill-coef x the reverse KL between the student's and the teacher's next-token "
        "distributions on the teacher's k most likely ids (both renormalized there) to every "
        "trained token's loss, differentiable (k teacher logprobs per token: no sampling "
        "variance on that support). Default: the sampled-token variant.",
        parse=int,
        minimum=1,
        resume=True,
        spellings=("NeMo-RL: distillation.topk_logits_k",),
    )

    @property
    def enabled(self) -> bool:
        """Whether a teacher is given and its term weighs anything."""
        return self.distill_teacher is not None and self.coef != 0

    @property
    def coef(self) -> float:
        """The teacher term's weight (1 for ``only``; 0 when the value does not parse)."""
        if self.distill_coef == ONLY:
            return 1.0
        try:
            return float(self.distill_coef)
        except ValueError:
            return 0.0

    @property
    def remote(self) -> bool:
        """Whether the teacher is a server (an ``http(s)://`` URL) rather than a directory."""
        return self.distill_teacher is not None and is_server_url(self.distill_teacher)

    @property
    def reward(self) -> bool:
        """Whether the environment's advantage stays in the sum (False for ``only``)."""
        return self.distill_coef != ONLY

    def problems(self) -> list[str]:
        errors = []
        if self.distill_coef != ONLY:
            try:
                value = float(self.distill_coef)
            except ValueError:
                value = -1.0
            if not value >= 0:
                errors.append(
                    f"--distill-coef must be a number >= 0 or '{ONLY}', got {self.distill_coef!r}"
                )
        if self.distill_teacher is None and self.distill_coef != "1":
            errors.append("--distill-coef needs --distill-teacher (the teacher to distill from)")
        if self.distill_teacher is None and self.distill_topk_logits_k is not None:
            errors.append(
                "--distill-topk-logits-k needs --distill-teacher (the teacher to distill from)"
            )
        return errors


def teacher_kind(directory: str) -> str | None:
    """``hf`` (config.json), ``checkpoint`` (our tracker file) or None (neither)."""
    path = Path(directory)
    if (path / "config.json").is_file():
        return "hf"
    if (path / TRACKER).is_file():
        return "checkpoint"
    return None


def distill_problems(distill: Distillation, model: Model, grpo: GRPO) -> list[str]:
    """What keeps ``--distill-teacher`` from running with the policy's ``model`` and ``grpo``
    options."""
    if distill.distill_teacher is None:
        return []
    directory = distill.distill_teacher
    if distill.remote:
        errors = _remote_problems(distill)
    elif not Path(directory).is_dir():
        return [f"--distill-teacher: no such directory {directory!r}"]
    elif teacher_kind(directory) is None:
        return [
            f"--distill-teacher {directory}: neither a Hugging Face model directory (no "
            f"config.json), nor a checkpoint directory of ours (no {TRACKER}), nor a server URL "
            "(http:// or https://)"
        ]
    else:
        hf = teacher_kind(directory) == "hf"
        errors = _tokenizer_problems(model, directory) if hf else []
    return errors + _objective_problems(distill, grpo) if distill.enabled else errors


def _objective_problems(distill: Distillation, grpo: GRPO) -> list[str]:
    """Why the objective of ``--distill-coef`` / ``--distill-topk-logits-k`` does not go with
    the surrogate or the sampling (nothing when it does)."""
    from megatron.rl.grpo.policy_loss import load_policy_loss

    errors = []
    topk = distill.distill_topk_logits_k is not None  # a loss term: any surrogate takes it
    if not topk and not load_policy_loss(grpo.policy_loss).token_advantages:
        errors.append(
            f"--distill-teacher with --policy-loss {grpo.policy_loss}: its ratio is per "
            "sequence and takes one advantage per sequence; the teacher's advantage is per "
            "token (use a per-token surrogate: vanilla or cispo, or the top-k variant "
            "--distill-topk-logits-k, a loss term)"
        )
    if not distill.reward and grpo.filter_groups_with_same_reward:
        errors.append(
            "--distill-coef only with --grpo-filter-groups-with-same-reward: the reward is not "
            "used, so no group should be dropped for its rewards"
        )
    return errors


def _remote_problems(distill: Distillation) -> list[str]:
    """Why the server URL of ``--distill-teacher`` cannot be a teacher (nothing when it can)."""
    from urllib.parse import urlsplit

    url, errors = distill.distill_teacher, []
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port that is not a number raises)
    except ValueError as err:
        return [f"--distill-teacher {url}: not a server URL ({err})"]
    if not parts.hostname or parts.path not in ("", "/") or parts.query:
        errors.append(
            f"--distill-teacher {url}: give the server's base URL (scheme, host and port, "
            "e.g. http://teacher:8000); /v1/completions is added"
        )
    if distill.enabled and distill.distill_topk_logits_k is not None:
        errors.append(
            f"--distill-topk-logits-k with a server as --distill-teacher ({url}): an OpenAI "
            "answer names the alternatives by their text, not their token ids (the top-k "
            "variant needs a local teacher)"
        )
    return errors


def _tokenizer_problems(model: Model, directory: str) -> list[str]:
    """Why the Hugging Face teacher's tokenizer is not the policy's (nothing when it is)."""
    mine = model.tokenizer_model if model.tokenizer_type == "HuggingFaceTokenizer" else None
    if mine is None:
        return [
            f"--distill-teacher {directory}: a Hugging Face teacher needs the policy's tokenizer "
            "to be a Hugging Face one (--hf-checkpoint or --tokenizer-model) to compare them; "
            "give a checkpoint directory of ours instead"
        ]
    try:
        theirs, ours = _vocab(Path(directory)), _vocab(Path(mine))
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ...
        return [f"--distill-teacher {directory}: cannot load its tokenizer ({err})"]
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        return [
            f"--distill-teacher {directory}: its tokenizer is not the policy's ({mine}): "
            f"{len(theirs)} vs {len(ours)} tokens, e.g. {differ} differ; distillation compares "
            "logprobs token by token, so both must use the same tokenizer"
        ]
    return []


def _vocab(directory: Path) -> dict[str, int]:
    """Token -> id of a Hugging Face tokenizer directory (special tokens included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return dict(tokenizer.get_vocab())
