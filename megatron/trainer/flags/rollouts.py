"""The rollout options: forced lag, sampling defaults, environments, failed rollouts and the data
plane; and the inference engine's: slots, schedule, and the server remote environments use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.rl.tools.parsers import DEFAULT_PARSER, parser_choices
from megatron.trainer.flags.megatron_lm import aliases_of
from megatron.trainer.flags.option import COMMANDS, EVALUATE, SERVE, Section, option

if TYPE_CHECKING:
    from megatron.rl.agent.mixture import MixtureAgent


@dataclass(frozen=True)
class Rollouts(Section):
    """What is generated, from which environments, and how far ahead of training."""

    title = "rollouts (forced lag, sampling, environments)"
    prefix = "rl-"

    forced_lag: int = option(
        0,
        "L: step N+L trains on rollouts submitted at step N (0 = on-policy).",
        minimum=0,
        resume=True,
        common=True,
    )
    submission_granularity: str = option(
        "B",
        "Megatron-LM's unit of submission through the gate: B (whole batches: with "
        "--rl-forced-lag L, step N+L trains exactly batch N) or G (one group at a time through a "
        "gate of max(1, round((L+1) x P)) groups for --rl-generation-lag L, each group's unit "
        "released when the trainer consumes it; needs --rl-partial-rollouts). R (rollouts) is "
        "not implemented yet.",
        choices=("R", "G", "B"),
        resume=True,
    )
    consumption_granularity: str = option(
        "B",
        "Megatron-LM's unit the trainer consumes: B (a batch once all its groups are in) or G "
        "(each group as soon as it and every group before it are in, releasing its gate unit "
        "then). Never finer than --rl-submission-granularity; R is refused, as in Megatron-LM. "
        "The order is the submission order: what a step trains never depends on timing.",
        choices=("R", "G", "B"),
        resume=True,
    )
    generation_lag: float | None = option(
        None,
        "Megatron-LM's lag, >= -1, possibly fractional: the gate holds max(1, round((L+1) x "
        "units per batch)) submission units (-1: one unit in flight). With B/B an integer L is "
        "--rl-forced-lag L. Unset with --rl-partial-rollouts: autotuned to fill the engine, "
        "max(1, --inference-max-requests // G) / P - 1. Exclusive with "
        "--rl-max-inflight-requests and --rl-forced-lag.",
        parse=float,
        resume=True,
    )
    max_inflight_requests: int | None = option(
        None,
        "Megatron-LM's in-flight limit M, another spelling of the lag: --rl-generation-lag "
        "M / (P x G) - 1.",
        parse=int,
        minimum=1,
        resume=True,
    )
    partial_rollouts: bool = option(
        False,
        "Let generation span weight updates in units finer than a batch (Megatron-LM's switch, "
        "required by --rl-submission-granularity G); every token keeps the policy version that "
        "generated it.",
        negatable=True,
    )
    env_config: str | None = option(
        None,
        "Env-config YAML (list of {agent_type, agent_args, weight}); default: the built-in "
        "digit-copy task.",
        flag="--env-config",
        aliases=aliases_of("--env-config"),
        parse=str,
        common=True,
        commands=(EVALUATE,),
    )
    default_temperature: float = option(
        1.0,
        "Sampling temperature (0 = greedy).",
        common=True,
        spellings=("TRL: temperature",),
        commands=(EVALUATE,),
    )
    default_top_p: float = option(
        0.0, "Nucleus mass (0 or 1 = off).", spellings=("TRL: top_p",), commands=(EVALUATE,)
    )
    default_top_k: int = option(
        -1, "Top-k (-1 or 0 = off).", spellings=("TRL: top_k",), commands=(EVALUATE,)
    )
    default_max_tokens: int = option(
        16,
        "Generation budget when the environment sets none.",
        minimum=1,
        common=True,
        spellings=("TRL: max_completion_length",),
        commands=(EVALUATE,),
    )
    ignore_eos: bool = option(
        False,
        "Generate every rollout to its full token budget: EOS and the tokenizer's other stop "
        "tokens do not end a generation (the same work per rollout, e.g. to compare throughput "
        "with another trainer).",
        switch=True,
    )
    max_failed_rollout_fraction: float = option(
        0.5,
        "Stop the run, naming the environment and its first error, once more than this share of "
        "an environment's rollouts failed (environment errors become masked placeholder "
        "rollouts, in process and behind the env server alike; each distinct error is logged "
        "once). Judged once the environment produced --grpo-prompts-per-step x --grpo-group-size "
        "rollouts; 1 never stops (a batch whose every rollout failed always does).",
    )
    data_plane: str = option(
        "in-process",
        "Where each collection's rollouts live: rank 0 writes each sample once under its own key "
        "and every data-parallel rank fetches only the keys of its shard (logprobs and reference "
        "logprobs are written back as fields; the partition is cleared when the collection "
        "ends). 'in-process': rank 0 holds the store and serves it point to point; "
        "'transferqueue': the TransferQueue package on Ray (pip install '.[transferqueue]'; rank "
        "0 starts a local Ray, the other ranks attach to it).",
        choices=("in-process", "transferqueue"),
    )

    def problems(self) -> list[str]:
        errors = []
        if self.default_temperature < 0:
            errors.append("--rl-default-temperature must be >= 0")
        if not 0 <= self.default_top_p <= 1:
            errors.append("--rl-default-top-p must be in [0, 1] (0 = off)")
        if self.default_top_k < -1:
            errors.append("--rl-default-top-k must be >= -1 (-1 or 0 = off)")
        if not 0 <= self.max_failed_rollout_fraction <= 1:
            errors.append(
                f"--rl-max-failed-rollout-fraction must be in [0, 1], got "
                f"{self.max_failed_rollout_fraction}"
            )
        if self.env_config is not None and not Path(self.env_config).is_file():
            errors.append(f"--env-config: no such file {self.env_config!r}")
        return errors


@dataclass(frozen=True)
class Inference(Section):
    """The engine's slots and schedule, and the inference server of remote environments."""

    title = "inference engine and server"
    prefix = "rl-"

    max_requests: int = option(
        64,
        "Concurrent generation requests (KV-cache slots) of the whole job, split evenly over "
        "the data-parallel replicas; keeping it fixed keeps the generation schedule, and so the "
        "results, independent of the parallel layout.",
        flag="--inference-max-requests",
        minimum=1,
        common=True,
        commands=COMMANDS,
    )
    deterministic_schedule: bool = option(
        True,
        "Step the requests of later batches only while the batch the trainer waits for still "
        "generates, so which policy version generates each token, and the whole run, is "
        "reproducible. --no-rl-deterministic-schedule keeps every batch in flight generating for "
        "the whole window, also while the awaited batch's rewards are computed or a new batch's "
        "requests are being sent: faster with slow rewards, but tokens then depend on timing "
        "(submission staleness stays exact).",
        negatable=True,
    )
    reward_wait_steps: int = option(
        0,
        "With --rl-deterministic-schedule: once the batch the trainer waits for has finished "
        "generating, the engine steps the later batches in flight for this many more engine "
        "steps (fewer if they have nothing left to generate), and the trainer takes the batch "
        "only after them, whatever the rewards' timing. Fills the wait for slow rewards with "
        "generation and keeps the run reproducible; tokens of later batches then come from "
        "earlier policy versions. 0: later batches step only while the awaited batch generates.",
        minimum=0,
    )
    outside_request_slots: int = option(
        4,
        "KV-cache slots reserved for requests from outside training (to the inference server: "
        "people, judges, evaluators; anything without a rollout key), on top of "
        "--inference-max-requests and split over the data-parallel replicas (at least one "
        "each). With the deterministic schedule such a request is answered within about its "
        "max_tokens engine steps while the trainer waits for a batch, and the run's tokens are "
        "the same as without it (its rows run in a forward of their own). 0: outside requests "
        "wait for a slot the rollouts leave free (at lag > 0, often the whole run) and shift "
        "the rollouts' schedule.",
        minimum=0,
    )
    inference_server_host: str = option(
        "127.0.0.1",
        "Interface of the inference server that remote environments (agent_type: remote) "
        "generate through; 0.0.0.0 to reach it from other hosts.",
    )
    inference_server_port: int = option(0, "Port of that inference server (0: a free port).")
    max_request_body_mib: float = option(
        8.0,
        "Largest request body the inference server (and serve) reads, MiB: a larger one is "
        "answered 413 before it is read whole.",
        minimum=0.001,
        commands=(SERVE,),
    )
    max_request_tokens: int = option(
        65536,
        "Largest n x max_tokens of one outside request (no rollout key) to the inference server "
        "(and serve): a larger one is answered 422. Rollouts are the trainer's own and exempt.",
        minimum=1,
        commands=(SERVE,),
    )
    max_requests_per_client: int = option(
        16,
        "Outside requests one client address may have running on the inference server (and "
        "serve); more wait their turn in the queue (--rl-max-queued-requests). A client that "
        "disconnects cancels its request (its KV-cache slot is freed at the next engine step).",
        minimum=1,
        commands=(SERVE,),
    )
    max_queued_requests: int = option(
        512,
        "Outside requests the inference server (and serve) queues while the engine's slots for "
        "them are taken (or their client has --rl-max-requests-per-client running): served "
        "round robin across client addresses, a queued request whose client disconnects leaves "
        "at once. Past this many queued in all, or half of it from one client address, a request "
        "is answered 429 with a Retry-After header. Rollouts are exempt.",
        minimum=1,
        commands=(SERVE,),
    )
    api_key_file: str | None = option(
        None,
        "File holding the job's shared key: the inference server requires it as a bearer token "
        "(401 without) and remote environments send it to env servers. Default: the environment "
        "variable MEGATRON_RL_API_KEY; neither: no key (keep servers on loopback).",
        parse=str,
        commands=(SERVE,),
    )
    tool_call_parser: str = option(
        "auto",
        "How the inference server's /v1/chat/completions reads tool calls out of the generated "
        "text (for requests with 'tools'): 'hermes' (<tool_call>{json}</tool_call>: Hermes, "
        "Qwen 2.5/3), 'llama3_json' (Llama 3.1+ JSON calls), 'auto' (the tokenizer's chat "
        "template decides: <tool_call> -> hermes, <|python_tag|> or ipython -> llama3_json, "
        f"anything else -> {DEFAULT_PARSER}) or 'none' (text only; tool_choice 'required' or a "
        "named function is refused). Decoding is not constrained.",
        flag="--tool-call-parser",
        choices=parser_choices(),
        commands=(SERVE,),
    )

    def problems(self) -> list[str]:
        errors = []
        if self.reward_wait_steps != 0 and not self.deterministic_schedule:
            errors.append(
                "--rl-reward-wait-steps is a budget of the deterministic schedule: it has no "
                "effect with --no-rl-deterministic-schedule (every batch in flight already steps "
                "the whole window)"
            )
        if not 0 <= self.inference_server_port < 65536:
            errors.append("--rl-inference-server-port must be in [0, 65535]")
        if self.api_key_file is not None:
            from megatron.rl.auth import read_api_key

            try:
                read_api_key(self.api_key_file, {}, "--rl-api-key-file")
            except ValueError as err:
                errors.append(str(err))
        return errors


def env_config_problems(env_config: str | None, seq_length: int, agent: MixtureAgent) -> list[str]:
    """The options against the loaded env config's entries, each problem naming the file, the
    entry and the flag: an entry's own generation budget (``agent_args.max_tokens``, where its
    agent declares one) must leave room in ``--seq-length`` for a prompt of at least one token,
    as ``--rl-default-max-tokens`` must."""
    errors = []
    for entry in agent.evaluated:
        budget = getattr(entry.args, "max_tokens", None)
        if budget is not None and budget >= seq_length:
            errors.append(
                f"--env-config {env_config}, entry {entry.env_id!r}: agent_args.max_tokens "
                f"({budget}) must be smaller than --seq-length ({seq_length}) to leave room for "
                "the prompt"
            )
    return errors
