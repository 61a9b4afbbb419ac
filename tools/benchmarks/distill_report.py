r"""``distill.py``'s checks and outputs: the teacher's held-out accuracy and the copy check from
evaluation dumps (``--val-dump-dir`` JSONL files), the target check from the evaluations, and
``distill.md`` (``markdown``) and ``distill.png`` (``plot``) drawn from the json alone.

The copy check compares greedy responses problem by problem (joined on ``problem_id``). A
response's final answer is the one the arithmetic reward scores
(``examples.rl.environments.gsm8k.answers.extract_answer`` in ``auto`` mode: the content of the
last non-empty ``\boxed{}``, else the text after the last ``####``, else the last number),
normalised by ``normalise_answer`` (whitespace, ``$``, thousands commas and a trailing period
dropped, ``26.0`` read as ``26``); two answers agree when both exist and are equal after that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_greedy(path: Path) -> dict[str, dict[str, Any]]:
    """The greedy pass of an evaluation dump: problem id -> its row (response, reward, ...)."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["pass"] == "greedy":
                rows[row["problem_id"]] = row
    return rows


def normalise_answer(answer: str | None) -> str | None:
    """``answer`` without surrounding space, ``$``, thousands commas or a final period; a number
    written with a zero fraction (``26.0``) as its integer."""
    if answer is None:
        return None
    text = answer.strip().strip("$").replace(",", "").rstrip(".").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


def final_answer(response: str) -> str | None:
    """The answer the arithmetic reward would score in ``response``, normalised, or None."""
    from examples.rl.environments.gsm8k.answers import extract_answer

    return normalise_answer(extract_answer(response, "auto"))


def greedy_accuracy(path: Path) -> dict[str, Any]:
    """Greedy accuracy of one dump (reward > 0 counts as right) with its 95% Wilson interval."""
    from megatron.rl.eval.confidence import wilson_interval

    rows = read_greedy(path)
    correct = sum(1 for r in rows.values() if r["reward"] > 0)
    versions = sorted({r["policy_version"] for r in rows.values()})
    return {
        "dump": str(path),
        "policy_version": versions[0] if len(versions) == 1 else versions,
        "prompts": len(rows),
        "correct": correct,
        "greedy_accuracy": correct / len(rows) if rows else 0.0,
        "greedy_ci95": list(wilson_interval(correct, len(rows))),
    }


def copy_check(teacher: Path, student: Path) -> dict[str, Any]:
    """On the held-out problems the teacher's greedy answer gets wrong: how many the student gets
    right, how many of its responses equal the teacher's exactly, how many give the same wrong
    final answer; plus exact agreement over all shared problems for context."""
    ours, theirs = read_greedy(student), read_greedy(teacher)
    shared = sorted(set(ours) & set(theirs))
    wrong = [p for p in shared if theirs[p]["reward"] == 0]
    student_wrong = [p for p in wrong if ours[p]["reward"] == 0]
    identical = [p for p in wrong if ours[p]["response"] == theirs[p]["response"]]
    same_answer = [
        p
        for p in student_wrong
        if (answer := final_answer(ours[p]["response"])) is not None
        and answer == final_answer(theirs[p]["response"])
    ]
    n = len(wrong)
    return {
        "student_dump": str(student),
        "shared_problems": len(shared),
        "teacher_wrong": n,
        "student_right": len(wrong) - len(student_wrong),
        "student_wrong": len(student_wrong),
        "identical_response": len(identical),
        "same_wrong_answer": len(same_answer),
        "identical_share": len(identical) / n if n else None,
        "same_wrong_answer_share": len(same_answer) / n if n else None,
        "identical_all_problems": sum(
            1 for p in shared if ours[p]["response"] == theirs[p]["response"]
        ),
    }


def first_reaching(evals: list[dict[str, Any]], low: float) -> dict[str, Any] | None:
    """The first evaluation whose greedy accuracy is at least ``low``, or None."""
    return next((e for e in evals if e["greedy_accuracy"] >= low), None)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _ci(e: dict[str, Any]) -> str:
    return f"{e['greedy_accuracy']:.1%} [{e['greedy_ci95'][0]:.1%}, {e['greedy_ci95'][1]:.1%}]"


def _trajectory(evals: list[dict[str, Any]]) -> str:
    return " -> ".join(f"{e['step']}: {_ci(e)}" for e in evals)


def _metric(steps: list[dict[str, Any]], key: str) -> str:
    values = [s[key] for s in steps if s.get(key) is not None]
    return f"{values[0]:.3f} -> {values[-1]:.3f}" if values else "n/a"


def markdown(res: dict[str, Any]) -> str:
    """The tables: accuracy and target per run, the distillation metrics, the copy check."""
    rl, teacher, third = res["rl"], res["teacher"], res["third_of_rl_steps"]
    target = rl["target"]
    lines = [
        f"Teacher `{res['settings']['teacher']}`: greedy accuracy {_ci(teacher)} "
        f"({teacher['correct']}/{teacher['prompts']} held-out problems, dump "
        f"`{teacher['dump']}`).",
        "",
        f"Target: the RL run's ({rl['name']}) step-{target['step']} greedy accuracy "
        f"{_ci(target)}; a run reaches it at the first evaluation whose accuracy is at least "
        f"{target['greedy_ci95'][0]:.1%}; a third of the RL run's steps is {third:.2f}.",
        "",
        "| run | steps | training wall time | greedy accuracy by step [95% CI] | pass@1 start -> last |"
        f" reaches {target['greedy_ci95'][0]:.1%} at step (wall time) | within a third |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in [(f"{rl['name']} (RL)", rl)] + list(res["runs"].items()):
        evals = run["evals"]
        wall = run["steps"][-1]["seconds"] if run["steps"] else 0.0
        hit = run["reaches"]
        reached = "no" if hit is None else f"{hit['step']} ({hit['seconds'] / 60:.1f} min)"
        within = "-" if hit is None else ("yes" if hit["within_third"] else "no")
        lines.append(
            f"| {name} | {run['steps'][-1]['step'] if run['steps'] else 0} | "
            f"{wall / 60:.1f} min | {_trajectory(evals)} | "
            f"{evals[0]['pass@1']:.1%} -> {evals[-1]['pass@1']:.1%} | {reached} | {within} |"
        )
    lines += [
        "",
        "Distillation metrics over trained tokens, first -> last step:",
        "",
        "| run | reverse KL | teacher log-prob | student log-prob | teacher argmax != sampled |",
        "|---|---|---|---|---|",
    ]
    for name, run in res["runs"].items():
        steps = run["steps"]
        lines.append(
            f"| {name} | {_metric(steps, 'distill/reverse_kl')} | "
            f"{_metric(steps, 'distill/teacher_logprob')} | "
            f"{_metric(steps, 'distill/student_logprob')} | "
            f"{_metric(steps, 'distill/argmax_mismatch')} |"
        )
    lines += [
        "",
        "Copy check, on the held-out problems the teacher's greedy answer gets wrong (shares of"
        " those; final answer: the reward's extraction, the last non-empty `\\boxed{}`, else the"
        " text after `####`, else the last number; step 0 is the untrained model, the baseline):",
        "",
        "| run | student at step | teacher wrong | student right | identical response |"
        " same wrong final answer | identical response, all problems |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in res["runs"].items():
        for label, check in run["copy_check"].items():
            lines.append(
                f"| {name} | {label} | {check['teacher_wrong']} | {check['student_right']} | "
                f"{check['identical_response']} ({_pct(check['identical_share'])}) | "
                f"{check['same_wrong_answer']} ({_pct(check['same_wrong_answer_share'])}) | "
                f"{check['identical_all_problems']}/{check['shared_problems']} |"
            )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    """Greedy held-out accuracy (95% CI) against steps and against training wall-clock, for the
    RL run and each distillation run, the teacher as a horizontal band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    teacher = res["teacher"]
    runs = [(f"{res['rl']['name']} (RL)", res["rl"])] + list(res["runs"].items())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, x_of, label in (
        (axes[0], lambda e: e["step"], "training step"),
        (axes[1], lambda e: e["seconds"] / 60, "training wall-clock (minutes)"),
    ):
        for name, run in runs:
            evals = run["evals"]
            ax.errorbar(
                [x_of(e) for e in evals],
                [e["greedy_accuracy"] for e in evals],
                yerr=[
                    [e["greedy_accuracy"] - e["greedy_ci95"][0] for e in evals],
                    [e["greedy_ci95"][1] - e["greedy_accuracy"] for e in evals],
                ],
                marker="o",
                capsize=3,
                label=name,
            )
        ax.axhline(teacher["greedy_accuracy"], color="black", linestyle="--", label="teacher")
        ax.axhspan(*teacher["greedy_ci95"], color="black", alpha=0.08)
        ax.set_xlabel(label)
        ax.set_ylabel(f"held-out greedy accuracy ({teacher['prompts']} problems)")
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct on arithmetic: on-policy distillation against GRPO")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
