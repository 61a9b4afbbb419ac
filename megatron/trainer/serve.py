"""Serve a checkpoint on the inference engine with OpenAI-style endpoints.

    python -m megatron.trainer.serve --hf-checkpoint DIR --seq-length 1024 [--host H --port P]
    python -m megatron.trainer.serve --load CK [--ckpt-step N] --hf-checkpoint DIR

The model is loaded as the trainer loads it (``checkpoint_model``: the trainer's flags and
validation, a Hugging Face or trainer checkpoint), on the engine the trainer generates its
rollouts with: the tier's ``ContinuousBatchingScheduler`` over its row runner, in a
``GenerationHost``. The server is the trainer's own (``create_inference_app``): ``GET /health``,
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``POST /v1/rollouts/end``. What differs from the trainer:

* The engine runs the throughput schedule (``SchedulerConfig.window_target=False``): a request
  steps as soon as it is admitted, with whatever else is in flight (continuous batching), instead
  of waiting for a training batch's turn; one generation window stays open for the server's life.
  With no request in flight the engine's loop sleeps until one arrives.
* Every token reports the checkpoint's policy version (its iteration; 0 for a Hugging Face
  checkpoint).
* ``--lora NAME=DIR ...`` (one or more, cpu tier) serves PEFT adapter directories beside the base: a
  request's ``model`` names one (404 for a name not served), the base answers its own name; rows
  of different adapters step together, one forward per adapter.

Requests beyond the engine's free slots (or ``--rl-max-requests-per-client`` running from one
address) wait their turn in the server's queue, round robin across client addresses; past
``--rl-max-queued-requests`` queued they are answered 429 with ``Retry-After``
(``megatron.rl.server.fair_queue``).

With the job's key (``MEGATRON_RL_API_KEY``, or ``--rl-api-key-file``) every request needs
``Authorization: Bearer <key>`` (401 otherwise); listening on another interface than loopback
without a key is refused. Once listening it prints one line, ``serving <model> at
http://HOST:PORT/v1 (key required, from SOURCE|no key)`` (SOURCE: the flag and file or the
variable; never the key); SIGTERM or SIGINT stop it (requests in flight get a
few seconds) with status 0. One process: a torchrun world larger than one is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Iterator

from megatron.trainer.flags.option import SERVE
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.runtime.exits import run_main
from megatron.trainer.runtime.kernels import kernel_warnings

with kernel_warnings() as MISSING_KERNELS:  # megatron-core's "not installed" warnings: one line
    from fastapi import FastAPI

    from megatron.rl.auth import API_KEY_ENV, api_key_source, listen_problem, read_api_key
    from megatron.rl.inference.interface import LocalInferenceInterface
    from megatron.rl.lora.config import AdapterConfigError, LoRAConfig, read_adapter_config
    from megatron.rl.lora.model import add_named_adapters
    from megatron.rl.lora.peft import AdapterLoadError, load_adapter_directory
    from megatron.rl.server.http import EmbeddedServer
    from megatron.rl.server.inference_server import create_inference_app
    from megatron.trainer import config
    from megatron.trainer.checkpoint_model import (
        command_parser,
        default_model_name,
        describe,
        load_checkpoint_model,
        parse_command_args,
    )
    from megatron.trainer.generation.host import GenerationHost
    from megatron.trainer.runtime.initialize import initialize_distributed, shutdown_distributed

PROG = "megatron.trainer.serve"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def build_serve_parser() -> argparse.ArgumentParser:
    """The trainer's flags plus the server's own; ``--help`` lists those serve reads (model,
    checkpoint, tokenizer, ``--inference-max-requests``, ``--rl-api-key-file``,
    ``--tool-call-parser``, ...), ``--help-all`` every one."""
    parser = command_parser(
        PROG,
        "Serve a Hugging Face (--hf-checkpoint) or trainer (--load) checkpoint on the trainer's "
        "inference engine with OpenAI-style endpoints (/v1/models, /v1/completions, "
        "/v1/chat/completions). The model flags are pretrain_grpo.py's; --seq-length bounds "
        "prompt + completion, --inference-max-requests the requests decoded at once. One process "
        "(world size 1); runs until SIGTERM or SIGINT, then exits 0.",
        SERVE,
    )
    g = parser.add_argument_group("serving")
    g.add_argument(
        "--host",
        type=str,
        default="127.0.0.1",
        help=f"Interface to listen on; any other than loopback needs the job's key "
        f"({API_KEY_ENV} or --rl-api-key-file).",
    )
    g.add_argument(
        "--port", type=int, default=8000, help="Port to listen on (0: a free one, printed)."
    )
    g.add_argument(
        "--lora",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="Serve each PEFT adapter directory DIR on the base model as model NAME (one or more: "
        "a request's model field picks one, the base answers its own name; cpu tier).",
    )
    g.add_argument(
        "--served-model-name",
        type=str,
        default=None,
        help="The model's id in /v1/models and in answers (default: the name of the checkpoint "
        "directory, --load's else --hf-checkpoint's).",
    )
    return parser


def served_key(cfg: RunConfig) -> str | None:
    """The job's key: ``--rl-api-key-file``'s, else ``MEGATRON_RL_API_KEY``'s, else None."""
    return read_api_key(cfg.inference.api_key_file, os.environ, "--rl-api-key-file")


def served_key_source(cfg: RunConfig) -> str:
    """Where ``served_key`` takes the key from (``auth.api_key_source``), never the key."""
    return api_key_source(cfg.inference.api_key_file, os.environ, "--rl-api-key-file")


def serve_problems(cfg: RunConfig, own: argparse.Namespace) -> list[str]:
    """The server flags' problems, each naming its flags (the key file is checked already)."""
    errors = []
    if not 0 <= own.port <= 65535:
        errors.append(f"--port must be in [0, 65535], got {own.port}")
    if own.served_model_name is not None and not own.served_model_name.strip():
        errors.append("--served-model-name must not be empty")
    errors += lora_problems(cfg, own.lora)
    refused = listen_problem(own.host, served_key(cfg) is not None, "--host", "--rl-api-key-file")
    if refused:
        errors.append(refused)
    return errors


def named_adapters(values: list[str]) -> dict[str, str]:
    """``--lora NAME=DIR`` values -> {name: directory} (``ValueError`` naming a bad one)."""
    named: dict[str, str] = {}
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or not name.strip() or not directory:
            raise ValueError(f"--lora {value!r}: expected NAME=DIR")
        if name in named:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        named[name] = directory
    return named


def lora_problems(cfg: RunConfig, values: list[str]) -> list[str]:
    """Why the ``--lora`` adapters cannot be served (each message naming the flag)."""
    if not values:
        return []
    if cfg.lora.enabled:
        return [
            "--lora with --lora-checkpoint or --lora-rank: give every adapter as --lora NAME=DIR"
        ]
    try:
        named = named_adapters(values)
    except ValueError as err:
        return [str(err)]
    errors = []
    for name, directory in named.items():
        try:
            read_adapter_config(directory)
        except AdapterConfigError as err:
            errors.append(f"--lora {name}={directory}: {err}")
    return errors


def load_named_adapters(model, named: dict[str, str]) -> None:
    """Each ``--lora`` directory as a named adapter set on ``model``."""
    for name, directory in named.items():
        saved = read_adapter_config(directory)
        config = LoRAConfig(saved.rank, saved.alpha, saved.targets, rslora=saved.rslora)
        try:
            load_adapter_directory(add_named_adapters(model, name, config), directory)
        except (AdapterLoadError, ValueError) as err:
            raise SystemExit(f"{PROG}: error: --lora {name}={directory}: {err}") from None


def parse_serve_args(
    argv: list[str] | None = None,
) -> tuple[RunConfig, argparse.Namespace]:
    """The run config and the server's own options, validated; ``UsageError`` (status 2) naming every bad one."""
    return parse_command_args(build_serve_parser(), argv, serve_problems)


def serve(cfg: RunConfig, own: argparse.Namespace) -> None:
    """Load the checkpoint, build the engine and serve until SIGTERM or SIGINT."""
    ctx = initialize_distributed(cfg)
    host = None
    try:
        loaded = load_checkpoint_model(cfg, ctx)
        named = named_adapters(own.lora)
        if named and loaded.tier.name != "cpu":
            raise SystemExit(
                f"{PROG}: error: --lora: several adapters are served by the cpu tier only "
                "(megatron-core's engine steps every request with one set of weights)"
            )
        load_named_adapters(loaded.model, named)
        print(describe(loaded, cfg, ctx, MISSING_KERNELS), flush=True)
        if named:
            print(f"adapters     {', '.join(f'{n} ({d})' for n, d in named.items())}", flush=True)
        throughput = dataclasses.replace(
            config.scheduler_config(cfg, ctx.dp_size, loaded.tokenizer, training=False),
            window_target=False,
        )
        host = GenerationHost(
            ctx,
            loaded.tier,
            loaded.model,
            throughput,
            loaded.tokenizer.vocab_size,
            lambda: loaded.policy_version,
        )
        name, key = own.served_model_name or default_model_name(cfg), served_key(cfg)
        inference = LocalInferenceInterface(host.engine, loaded.tokenizer)
        adapters = {
            n: LocalInferenceInterface(host.engine, loaded.tokenizer, adapter=n) for n in named
        }
        app = create_inference_app(
            inference,
            loaded.tokenizer,
            model_name=name,
            api_key=key,
            tool_call_parser=cfg.inference.tool_call_parser,
            adapters=adapters,
            limits=config.server_limits(cfg, engine_slots=host.engine.outside_capacity),
        )
        source = served_key_source(cfg) if key is not None else None
        host.window(lambda: listen_until_stopped(app, own.host, own.port, name, source))
    finally:
        if host is not None:
            host.close(host.engine.aclose)
        shutdown_distributed()


async def listen_until_stopped(
    app: FastAPI, host: str, port: int, name: str, key_source: str | None
) -> None:
    """Serve ``app`` on ``host:port``, print where (and where the key came from, ``key_source``;
    None: no key), and return after SIGTERM or SIGINT once the server has stopped (the signals
    are caught before the line is printed)."""
    with stop_signals() as stopped:
        try:
            server = await EmbeddedServer.start(app, host, port)
        except OSError as exc:
            raise SystemExit(
                f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        try:
            keyed_text = "no key" if key_source is None else f"key required, from {key_source}"
            print(f"serving {name} at {server.url}/v1 ({keyed_text})", flush=True)
            signum = await stopped
            print(f"{signal.Signals(signum).name}: stopping", flush=True)
        finally:
            await server.stop()


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Future[int]]:
    """SIGTERM and SIGINT handled by the running loop while the context lasts: the future
    yielded gets the first one's number."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        if not received.done():
            received.set_result(signum)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield received
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        received.cancel()


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, then serve."""
    serve(*parse_serve_args(argv))


if __name__ == "__main__":
    run_main(main, prog=PROG)
