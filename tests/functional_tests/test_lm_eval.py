"""lm-evaluation-harness (``lm-eval``, a client nobody here wrote) against
``python -m megatron.trainer.serve``, with the small arithmetic tasks shipped in
``test_cases/lm_eval/`` (20 sums, a local JSONL; nothing is downloaded).

* ``local-completions`` scores the multiple-choice task by log-likelihood through
  ``/v1/completions`` (token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``): every
  choice's log-likelihood, greedy flag, chosen answer and ``acc``/``acc_norm`` equal lm-eval's
  ``hf`` model on the same checkpoint directory.
* ``local-chat-completions`` answers the generation task through ``/v1/chat/completions`` (greedy,
  ``stop``): each answer is what the same request sent directly returns, and its exact-match score
  is that answer's last number's.
* ``slow``: both on SmolLM2-135M-Instruct (the scores against transformers' again; the
  accuracies are printed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from golden_values import ROOT
from serving import running_server

pytest.importorskip("lm_eval", reason="needs lm-eval (pip install -e '.[test]')")

TASKS = ROOT / "tests" / "functional_tests" / "test_cases" / "lm_eval"
MC, GEN = "megatron_arithmetic_mc", "megatron_arithmetic_gen"
SEED = 1234  # lm-eval's API models send it with every request
VOCAB = 300
CHAT = {"apply_chat_template": True}  # lm-eval sends chat models the conversation itself


@pytest.fixture(scope="module")
def scoring_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama 3 checkpoint whose embedding has exactly the tokenizer's rows, so that
    transformers' softmax (over every row) and the server's (over the tokenizer's ids) agree."""
    import transformers

    from megatron.rl.models.hf.tiny import make_tiny_checkpoint

    directory = make_tiny_checkpoint(
        "llama3", tmp_path_factory.mktemp("lm_eval") / "arith", vocab_size=VOCAB, seed=5
    )
    assert len(transformers.AutoTokenizer.from_pretrained(directory)) == VOCAB
    return directory


@pytest.fixture(scope="module")
def served(scoring_checkpoint):
    with running_server(["--hf-checkpoint", str(scoring_checkpoint), "--seq-length", "128"]) as s:
        yield s


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Run from the repository root (the tasks' data paths are relative to it), offline, with
    the datasets cache under ``tmp_path`` instead of the home directory."""
    import datasets

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")


def evaluate(model: str, model_args: dict, task: str, **kwargs) -> tuple[dict, list[dict]]:
    """lm-eval's ``simple_evaluate`` of one shipped task (no request cache, no output files);
    its numbers and its per-item records by document."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=manager,
        bootstrap_iters=0,
        log_samples=True,
        **kwargs,
    )
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    assert len(samples) == 20
    return results["results"][task], samples


def adds_bos(directory: Path) -> bool:
    """Whether the checkpoint's tokenizer starts a text with its BOS token (Llama 3's does,
    SmolLM2's does not): both lm-eval models are told so, as they default differently."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return tokenizer("1").input_ids != tokenizer("1", add_special_tokens=False).input_ids


def completions_args(served, directory: Path) -> dict:
    """``local-completions`` at the server, tokenizing with the checkpoint's own tokenizer."""
    return {
        "model": served.name,
        "base_url": f"{served.url}/completions",
        "tokenizer": str(directory),
        "tokenizer_backend": "huggingface",
        "max_retries": 1,  # a refused request fails the run at once
        "max_length": 128,
        "add_bos_token": adds_bos(directory),
    }


def hf_args(directory: Path) -> dict:
    return {
        "pretrained": str(directory),
        "dtype": "float32",
        "device": "cpu",
        "add_bos_token": adds_bos(directory),
    }


def scores(samples: list[dict]) -> list[list[tuple[float, bool]]]:
    """(log-likelihood, greedy) of each choice, per item."""
    return [[(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]] for s in samples]


def chosen(samples: list[dict]) -> list[int]:
    """The choice each item's highest log-likelihood picks."""
    return [max(range(len(s)), key=lambda i: s[i][0]) for s in scores(samples)]


def assert_same_scores(served: list[dict], hf: list[dict], tolerance: float) -> None:
    """Per item and choice: the same log-likelihood (within ``tolerance``), greedy flag, chosen
    answer and scores."""
    for mine, theirs in zip(scores(served), scores(hf)):
        assert [ll for ll, _ in mine] == pytest.approx([ll for ll, _ in theirs], abs=tolerance)
        assert [g for _, g in mine] == [g for _, g in theirs]
    assert chosen(served) == chosen(hf)
    for metric in ("acc", "acc_norm"):
        assert [s[metric] for s in served] == [s[metric] for s in hf]


def accuracies(numbers: dict) -> str:
    return f"acc {numbers['acc,none']:.2f}, acc_norm {numbers['acc_norm,none']:.2f}"


def test_lm_eval_scores_multiple_choice_through_echo_as_transformers_does(
    scoring_checkpoint, served, offline
):
    api, api_samples = evaluate(
        "local-completions", completions_args(served, scoring_checkpoint), MC
    )
    hf, hf_samples = evaluate("hf", hf_args(scoring_checkpoint), MC, batch_size=8)
    assert_same_scores(api_samples, hf_samples, tolerance=1e-3)
    assert (api["acc,none"], api["acc_norm,none"]) == (hf["acc,none"], hf["acc_norm,none"])
    assert len({ll for s in scores(api_samples) for ll, _ in s}) > 40  # really scored
    print(f"tiny model: served {accuracies(api)}; transformers {accuracies(hf)}")


def last_number(text: str) -> str:
    """What the generation task's filter scores: the answer's last number."""
    numbers = re.findall(r"-?[0-9]+", text)
    return numbers[-1] if numbers else "[invalid]"


def chat_args(served) -> dict:
    """``local-chat-completions`` at the server (it sends the conversation, no tokenizer)."""
    return {"model": served.name, "base_url": f"{served.url}/chat/completions", "max_retries": 1}


def test_lm_eval_generates_through_chat_completions(served, offline):
    numbers, samples = evaluate("local-chat-completions", chat_args(served), GEN, **CHAT)
    client = served.client()
    for sample in samples:
        context, gen_kwargs = sample["arguments"][0]
        messages = json.loads(context[0])  # the chat as lm-eval keeps it: (JSON text,)
        question = sample["doc"]["question"][:-1]
        assert messages == [
            {"role": "user", "content": f"What is {question}? Answer with the number only."}
        ]
        direct = client.chat.completions.create(
            model=served.name,
            messages=messages,
            max_tokens=gen_kwargs["max_gen_toks"],
            temperature=0,
            stop=gen_kwargs["until"],
            seed=SEED,
        )
        answer = direct.choices[0].message.content or ""
        assert "\n" not in answer
        assert sample["resps"] == [[answer]]
        assert sample["filtered_resps"] == [last_number(answer)]
        assert sample["exact_match"] == float(last_number(answer) == sample["target"])
    assert numbers["exact_match,last_number"] == pytest.approx(
        sum(s["exact_match"] for s in samples) / len(samples)
    )
    print(f"tiny model: exact match {numbers['exact_match,last_number']:.2f}")


@pytest.mark.slow
def test_smollm2_scores_multiple_choice_served_as_in_transformers(smollm2_checkpoint, offline):
    argv = ["--hf-checkpoint", str(smollm2_checkpoint), "--seq-length", "256"]
    with running_server(argv) as served:
        api, api_samples = evaluate(
            "local-completions", completions_args(served, smollm2_checkpoint), MC
        )
        gen, _ = evaluate("local-chat-completions", chat_args(served), GEN, **CHAT)
    hf, hf_samples = evaluate("hf", hf_args(smollm2_checkpoint), MC, batch_size=8)
    diff = max(
        abs(a[0] - b[0])
        for mine, theirs in zip(scores(api_samples), scores(hf_samples))
        for a, b in zip(mine, theirs)
    )
    print(
        f"SmolLM2-135M-Instruct, {MC}: served {accuracies(api)}; transformers {accuracies(hf)} "
        f"(largest log-likelihood difference {diff:.2e}); {GEN} through chat: exact match "
        f"{gen['exact_match,last_number']:.2f}"
    )
    assert_same_scores(api_samples, hf_samples, tolerance=1e-3)
    assert gen["exact_match,last_number"] >= 0.4  # it adds one-digit numbers (a random model: 0)
