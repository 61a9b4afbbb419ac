"""An inference rank's run under ``--refit-mode non-collocated``: its model, tier and pipeline
from the flags (``inference_run_config``), then ``generation/remote.py``'s ``serve_inference``."""

from __future__ import annotations

from megatron.rl.agent.api import Agent
from megatron.trainer import config
from megatron.trainer.flags.refit import inference_run_config
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.generation.remote import serve_inference
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import shutdown_distributed
from megatron.trainer.tiers import select_tier


def generate_only(cfg: RunConfig, ctx: ParallelContext, agent: Agent) -> None:
    """An inference rank's run (``serve_inference`` at ``inference_run_config(cfg)``), then the
    process groups' teardown."""
    try:
        cfg = inference_run_config(cfg)
        tier = select_tier(config.tier_config(cfg), ctx)
        tokenizer = config.tokenizer(cfg)
        pipeline = config.pipeline_config(cfg, ctx.dp_size, tokenizer)
        serve_inference(ctx, tier, tokenizer, agent if ctx.is_main else None, pipeline)
    finally:
        shutdown_distributed()
