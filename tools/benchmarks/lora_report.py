"""``lora.md``: the markdown of ``lora.json`` (``lora.py``'s three parts), a pure function of it."""

from __future__ import annotations

from typing import Any


def markdown(res: dict[str, Any]) -> str:
    """Both parts as markdown tables, with the ratios the targets are read from."""
    rows = {r["name"]: r for r in res.get("recipe_shape", [])}
    m, settings = res["machine"], res.get("settings", {})
    lines = [
        "# LoRA RL against full fine-tuning and TRL + PEFT",
        "",
        f"`tools/benchmarks/lora.py --steps {settings.get('steps')} --skip {settings.get('skip')} "
        f"--large-steps {res.get('large', {}).get('steps', 0)}`, {res.get('started', '?')}: "
        f"{m['cpu']}, {m['cores']} cores, {m['memory']}, torch {m['torch']}, megatron-core "
        f"{m['megatron.core']}, transformers {m['transformers']}, TRL {m['trl']}.",
        "",
    ]
    if rows:
        full = rows["full"]
        lines += [
            "| configuration | s/step | per round | training update s/step | peak RSS | "
            "generation / training peak | mismatch_kl |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows.values():
            ours = r["kind"] == "ours"
            rounds = ", ".join(f"{s:.1f}" for s in r["seconds_per_step_per_round"])
            lines.append(
                f"| {r['name']} | {r['seconds_per_step']:.2f} | {rounds} | "
                + (f"{r['train_seconds_per_step']:.2f}" if ours else "n/a")
                + f" | {r['peak_rss_mib']:.0f} MiB | "
                + (
                    f"{r['generation_peak_mib']:.0f} / {r['training_peak_mib']:.0f} MiB"
                    if ours
                    else "n/a"
                )
                + " | "
                + (f"{r['mismatch_kl']:.1e}" if ours else "n/a")
                + " |"
            )
        rank = res["rank"]
        lora, trl = rows[f"LoRA r={rank}"], rows[f"TRL + PEFT r={rank}"]
        no_recompute = rows[f"LoRA r={rank}, no recompute"]
        best = min((lora, no_recompute), key=lambda r: r["seconds_per_step"])
        lines += [
            "",
            f"* training update, full fine-tuning / LoRA r={rank} (both with recompute): "
            f"**{full['train_seconds_per_step'] / lora['train_seconds_per_step']:.2f}x**; "
            f"without recompute: "
            f"{full['train_seconds_per_step'] / no_recompute['train_seconds_per_step']:.2f}x",
            f"* whole step, TRL + PEFT / ours ({best['name']}): "
            f"**{trl['seconds_per_step'] / best['seconds_per_step']:.2f}x** "
            f"(with recompute: {trl['seconds_per_step'] / lora['seconds_per_step']:.2f}x)",
            f"* peak RSS: full {full['peak_rss_mib']:.0f} MiB, LoRA r={rank} "
            f"{lora['peak_rss_mib']:.0f} MiB ({lora['peak_rss_mib'] / full['peak_rss_mib']:.0%}), "
            f"TRL + PEFT {trl['peak_rss_mib']:.0f} MiB",
        ]
    engine = res.get("engine")
    if engine:
        tps = engine["tokens_per_second"]
        base = tps["adapters off (base)"]
        lines += [
            "",
            f"Engine decode, SmolLM2-135M bf16, batch {engine['batch']} x {engine['new_tokens']} "
            f"new tokens, rank {res['rank']} (median of {engine['repeats']}, interleaved):",
            "",
            "| variant | tokens/s | vs base | mismatch_kl vs training | "
            "max abs logprob difference |",
            "|---|---|---|---|---|",
        ]
        for name, rate in tps.items():
            err = engine["errors"].get(name)
            lines.append(
                f"| {name} | {rate:.0f} | {rate / base:.2f}x | "
                + (
                    f"{err['mismatch_kl']:.1e} | {err['max_abs_logprob_difference']:.3f} |"
                    if err
                    else "n/a | n/a |"
                )
            )
    large = res.get("large")
    if large:
        lines += [
            "",
            f"SmolLM2-1.7B shape ({large['parameters'] / 1e9:.2f}B parameters, random init), "
            f"LoRA r={res['large_rank']}, {large['steps']} steps of 2 x 4 rollouts x 32 tokens: "
            f"peak RSS **{large['peak_rss_mib'] / 1024:.1f} GiB** (generation "
            f"{large['generation_peak_mib'] / 1024:.1f} / training "
            f"{large['training_peak_mib'] / 1024:.1f} GiB), "
            f"s/step {', '.join(f'{s:.0f}' for s in large['seconds_per_step'])} (training update "
            f"{', '.join(f'{s:.0f}' for s in large['train_seconds_per_step'])}); full "
            f"fine-tuning's float32 weights + gradients + AdamW moments alone: "
            f"{large['full_finetuning_state_gib']:.1f} GiB, "
            + (
                "above"
                if large["full_finetuning_state_gib"] > large["machine_memory_gib"]
                else "within"
            )
            + f" the machine's {large['machine_memory_gib']:.1f} GiB.",
        ]
    return "\n".join(lines)
