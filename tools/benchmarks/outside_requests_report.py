"""``outside_requests.md``: the report of ``outside_requests.py``'s result (its json), latency
percentiles in seconds and engine steps, per route, and whether the training metrics stayed
bitwise equal."""

from __future__ import annotations

from typing import Any


def markdown(result: dict[str, Any]) -> str:
    """The report of ``measure``'s result."""
    s, e, t = result["seconds"], result["engine_steps"], result["train_seconds"]
    slots = result["outside_request_slots"]
    setting = "the default" if slots is None else str(slots)
    if not s["n"]:
        s = e = {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    lines = [
        "# Outside requests at the trainer's endpoint (deterministic schedule, forced lag 2)",
        "",
        f"`python tools/benchmarks/outside_requests.py`; {result['steps']} steps of a tiny Llama "
        "checkpoint on the digit-copy task behind an env server, key set (endpoint line: key "
        f"from {result['endpoint_key_source']}). One client, one request at a time, 4 tokens, "
        "alternating /v1/completions and /v1/chat/completions through `openai`. "
        f"`--rl-outside-request-slots`: {setting}.",
        "",
        "| | p50 | p99 | max | requests |",
        "|---|---|---|---|---|",
        f"| latency (s) | {s['p50']:.3f} | {s['p99']:.3f} | {s['max']:.3f} | {s['n']} |",
        f"| engine steps, arrival to answer | {e['p50']} | {e['p99']} | {e['max']} | {e['n']} |",
        f"| training step (s, engine suspended) | {t['p50']:.3f} | {t['p99']:.3f} | "
        f"{t['max']:.3f} | {t['n']} steps |",
    ]
    for route, r in result["by_route"].items():
        lines.append(
            f"| {route} latency (s) | {r['p50']:.3f} | {r['p99']:.3f} | {r['max']:.3f} "
            f"| {r['n']} |"
        )
    lines += [
        "",
        f"Requests not answered before the run ended: {len(result['unanswered_seconds'])} "
        f"(waited {', '.join(f'{x:.1f}' for x in result['unanswered_seconds']) or '-'} s).",
        "",
        f"Training metrics (losses, rewards, policy versions) bitwise equal to the run without "
        f"the client: **{result['metrics_bitwise_equal']}**. A request arriving during a training "
        "step waits for the next generation window: its wall-clock latency is bounded by that "
        "step's time (row above), its latency in engine steps is not affected.",
        "",
        f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores.",
    ]
    return "\n".join(lines) + "\n"
