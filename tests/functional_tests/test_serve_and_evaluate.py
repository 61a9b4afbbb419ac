"""``python -m megatron.trainer.serve`` and ``python -m megatron.trainer.evaluate`` as processes.

* serve: a tiny random Hugging Face checkpoint and a trainer checkpoint, driven by the ``openai``
  client (``/v1/models``, completions, chat completions, the job's key), answers checked against
  transformers' greedy generation of the same weights; idle without requests; SIGTERM ends it
  with status 0.
* evaluate: the same numbers and dump records as the trainer's own evaluation of the same weights
  (``--val-at-start`` before training, ``--val-at-end`` after it), the trainer's held-out split,
  JSON numbers that agree with the dump.
* bad input: one message naming the flag, status 2 for flags and 1 for a checkpoint, no
  traceback.
* ``slow``: the same on SmolLM2-135M-Instruct (a chat completion, four GSM8K problems).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from golden_values import ROOT, flag_argv
from serving import (
    KEY,
    Served,
    assert_greedy,
    assert_numbers_match_records,
    assert_one_message,
    command_env,
    hf_logprobs,
    read_records,
    run,
    start_server,
)

MATH_DATA = ROOT / "examples" / "rl" / "environments" / "math" / "tiny_arithmetic.jsonl"
GSM8K_DATA = ROOT / "examples" / "rl" / "environments" / "gsm8k" / "gsm8k_sample.jsonl"
MODEL_FLAGS = ["--seq-length", "64", "--rl-default-max-tokens", "6", "--seed", "7"]
EVAL_FLAGS = ["--eval-prompts", "3", "--eval-samples", "2", "--eval-pass-k", "1", "2"]
EVAL_FLAGS += ["--val-split-fraction", "0.5"]


@pytest.fixture
def servers():
    """Start servers with ``servers(argv, env)``; any still running at the end is killed."""
    started: list[Served] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Served:
        started.append(start_server(argv, env or command_env()))
        return started[-1]

    yield start
    for served in started:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()


# ------------------------------------------------------------------ tiny checkpoints


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoints) -> Path:
    return tiny_hf_checkpoints["llama3"]


@pytest.fixture(scope="module")
def env_config(tmp_path_factory) -> Path:
    """A file-backed math environment (8 problems) and the digit-copy task."""
    path = tmp_path_factory.mktemp("envs") / "envs.yaml"
    path.write_text(
        "- agent_type: examples.rl.environments.math:MathEnvironment\n"
        "  env_id: math\n"
        f"  agent_args: {{path: '{MATH_DATA}', max_tokens: 6}}\n"
        "- agent_type: digits\n"
        "  env_id: copy\n"
        "  agent_args: {task: copy, min_digits: 1, max_digits: 3}\n"
    )
    return path


@pytest.fixture(scope="module")
def trained(tiny, env_config, tmp_path_factory) -> dict[str, Path]:
    """One GRPO iteration from the tiny checkpoint: its trainer checkpoint ``CK``, its Hugging
    Face export and the trainer's evaluations before (eval-v0) and after (eval-v1) it."""
    out = tmp_path_factory.mktemp("trained")
    paths = {"ck": out / "CK", "hf": out / "exported", "dump": out / "trainer-dump"}
    argv = [
        *MODEL_FLAGS,
        *EVAL_FLAGS,
        *flag_argv(
            {
                "hf-checkpoint": str(tiny),
                "env-config": str(env_config),
                "grpo-prompts-per-step": "2",
                "grpo-group-size": "2",
                "micro-batch-size": "4",
                "train-iters": "1",
                "lr": "0.05",
                "lr-warmup-iters": "0",
                "val-at-start": True,
                "grpo-entropy-term-weight": "0.5",  # a gradient even where every reward is 0
                "val-at-end": True,
                "val-dump-dir": str(paths["dump"]),
                "save": str(paths["ck"]),
                "save-hf": str(paths["hf"]),
                "plot-file": "none",
            }
        ),
    ]
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", *argv],
        cwd=ROOT,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return paths


def test_served_hugging_face_checkpoint_answers_the_openai_client_greedily(tiny, servers):
    served = servers(
        ["--hf-checkpoint", str(tiny), "--seq-length", "64"],
        command_env(MEGATRON_RL_API_KEY=KEY),
    )
    assert (served.name, served.keyed) == ("llama3", True)

    outsider = served.client(key="not-the-key")
    with pytest.raises(openai.AuthenticationError):
        outsider.models.list()
    with pytest.raises(openai.AuthenticationError):
        outsider.completions.create(model="llama3", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        outsider.chat.completions.create(
            model="llama3", messages=[{"role": "user", "content": "hi"}]
        )

    client = served.client()
    (model,) = client.models.list().data
    assert (model.id, model.object, model.owned_by) == ("llama3", "model", "megatron-rl")
    started = time.monotonic()
    completion = client.completions.create(
        model="llama3", prompt="12+7=", max_tokens=8, temperature=0, logprobs=1
    )
    answer_seconds = time.monotonic() - started
    (choice,) = completion.choices
    tokens = assert_greedy(tiny, choice, 8)
    assert choice.model_extra["policy_versions"] == [0] * len(tokens)
    assert len(choice.logprobs.token_logprobs) == len(tokens) and completion.model == "llama3"
    chat = client.chat.completions.create(
        model="llama3",
        messages=[{"role": "user", "content": "What is 3+4?"}],
        max_completion_tokens=8,
        temperature=0,
    )
    tokens = assert_greedy(tiny, chat.choices[0], 8)
    assert chat.choices[0].model_extra["prompt_text"].endswith("<|assistant|>")
    assert answer_seconds < 30  # the throughput schedule answers at once (no batch to wait for)
    print(f"one 8-token completion answered in {answer_seconds:.2f} s")

    time.sleep(0.5)  # idle: nothing in flight, the engine sleeps
    idle_start, idle = served.cpu_seconds(), 3.0
    time.sleep(idle)
    idle_cpu = served.cpu_seconds() - idle_start
    assert idle_cpu < 0.3 * idle, f"{idle_cpu:.2f} CPU seconds in {idle} idle seconds"

    port = served.url.split(":")[-1].split("/")[0]
    taken = run("megatron.trainer.serve", ["--hf-checkpoint", str(tiny), "--port", port])
    assert_one_message(taken, 1, "megatron.trainer.serve: error: --host/--port: cannot listen")

    assert served.stop() == 0, served.stderr[-20:]
    assert served.stdout[-1] == "SIGTERM: stopping"
    assert not any("Traceback" in line for line in served.stderr), served.stderr
    print(f"idle: {idle_cpu:.3f} CPU seconds in {idle} s")


def test_a_burst_past_the_slots_and_the_per_client_limit_queues_and_is_answered(tiny, servers):
    """A harness's burst: 24 requests at once from one address, 4 engine slots, 16 running per
    client: the rest wait their turn (before the queue: 8 answered 429) and every answer is the
    greedy one."""
    served = servers(
        ["--hf-checkpoint", str(tiny), "--seq-length", "64", "--inference-max-requests", "4"]
    )
    prompts = [f"{i}+{i}=" for i in range(24)]

    async def burst():
        client = openai.AsyncOpenAI(base_url=served.url, api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(
                *(
                    client.completions.create(model="llama3", prompt=p, max_tokens=6, temperature=0)
                    for p in prompts
                )
            )
        finally:
            await client.close()

    for completion in asyncio.run(burst()):
        assert_greedy(tiny, completion.choices[0], 6)
    assert served.stop() == 0, served.stderr[-20:]


def test_served_trainer_checkpoint_generates_with_its_trained_weights(trained, tiny, servers):
    served = servers(
        ["--load", str(trained["ck"]), "--hf-checkpoint", str(tiny), "--seq-length", "64"]
    )
    assert (served.name, served.keyed) == ("CK", False)
    client = served.client(key="anything")
    choice = client.completions.create(
        model="CK", prompt="copy: 1234 -> ", max_tokens=10, temperature=0, logprobs=1
    ).choices[0]
    tokens = assert_greedy(trained["hf"], choice, 10)  # the exported trained weights
    assert choice.model_extra["policy_versions"] == [1] * len(tokens)
    prompt, logprobs = choice.model_extra["prompt_token_ids"], choice.logprobs.token_logprobs
    assert logprobs == pytest.approx(hf_logprobs(trained["hf"], prompt, tokens), abs=1e-4)
    initial = hf_logprobs(tiny, prompt, tokens)  # the weights before the training step
    assert max(abs(a - b) for a, b in zip(logprobs, initial)) > 1e-3
    assert served.stop(signal.SIGINT) == 0
    assert served.stdout[-1] == "SIGINT: stopping"


def test_evaluation_equals_the_trainers_before_and_after_training(
    trained, tiny, env_config, tmp_path
):
    common = [
        "--hf-checkpoint",
        str(tiny),
        "--env-config",
        str(env_config),
        *MODEL_FLAGS,
        *EVAL_FLAGS,
        "--val-dump-dir",
        str(tmp_path / "dump"),
    ]
    for version, extra in ((0, []), (1, ["--load", str(trained["ck"])])):
        output = tmp_path / f"eval-{version}.json"
        proc = run("megatron.trainer.evaluate", [*common, *extra, "--output-json", str(output)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = read_records(tmp_path / "dump" / f"eval-v{version}.jsonl")
        assert records == read_records(trained["dump"] / f"eval-v{version}.jsonl")
        numbers = json.loads(output.read_text())
        assert numbers["policy_version"] == version
        assert [e["env_id"] for e in numbers["environments"]] == ["math", "copy"]
        assert_numbers_match_records(numbers, records)
        table = proc.stdout.splitlines()
        (header,) = [line for line in table if line.startswith("environment ")]
        assert "greedy accuracy [95% CI]" in header and "pass@2" in header
        assert any(line.startswith("math ") for line in table)
        assert any(line.startswith("copy ") for line in table), proc.stdout
        print(proc.stdout)


def test_the_validation_split_is_the_trainers(trained, tmp_path, env_config):
    """The math problems evaluated are the first --eval-prompts of the trainer's held-out split
    (as the trainer's load_agent builds it for the same --val-split-fraction)."""
    from megatron.trainer.flags.parse import parse_args
    from megatron.trainer.grpo import load_agent

    flags = ["--env-config", str(env_config), "--val-split-fraction", "0.5", "--val-at-end"]
    cfg = parse_args([*flags, "--seq-length", "64", "--rl-default-max-tokens", "6"])
    (math,) = [a for a in load_agent(cfg).agents if a.env_id == "math"]
    held_out = [math.problem(i).problem_id for i in math.validation_indices[:3]]
    assert len(math.validation_indices) == 4
    for version in (0, 1):
        records = read_records(trained["dump"] / f"eval-v{version}.jsonl")
        greedy = [r for r in records if r["env_id"] == "math" and r["pass"] == "greedy"]
        assert [r["problem_id"] for r in greedy] == held_out
    training = {math.problem(i).problem_id for i in math.training_indices}
    assert not training & set(held_out)


def test_bad_input_ends_with_one_message(trained, tmp_path):
    for module in ("megatron.trainer.serve", "megatron.trainer.evaluate"):
        proc = run(module, ["--seq-length", "64"])
        assert_one_message(proc, 2, f"{module}: error: invalid arguments", "no checkpoint")
    proc = run("megatron.trainer.serve", ["--load", str(trained["ck"]), "--num-layers", "3"])
    assert_one_message(
        proc, 1, f"--load {trained['ck']}: iteration 1 was saved with --num-layers 2 (here: 3)"
    )
    broken = tmp_path / "CK"
    shutil.copytree(trained["ck"], broken)
    shard = broken / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run(
        "megatron.trainer.evaluate", ["--load", str(broken), "--hf-checkpoint", str(trained["hf"])]
    )
    assert_one_message(
        proc, 1, "megatron.trainer.evaluate: error: --load", str(shard), "cannot read iteration 1"
    )


# ------------------------------------------------------------------ a real model


@pytest.mark.slow
def test_smollm2_chat_completion_through_the_openai_client(smollm2_checkpoint, servers):
    served = servers(
        [
            "--hf-checkpoint",
            str(smollm2_checkpoint),
            "--seq-length",
            "256",
            "--inference-max-requests",
            "4",
        ]
    )
    client = served.client()
    (model,) = client.models.list().data
    assert model.id == Path(smollm2_checkpoint).name
    chat = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_completion_tokens=16,
        temperature=0,
    )
    (choice,) = chat.choices
    assert_greedy(smollm2_checkpoint, choice, 16)
    assert choice.message.content.strip()
    print(f"SmolLM2: {choice.message.content!r}")
    assert served.stop() == 0


@pytest.mark.slow
def test_smollm2_evaluates_four_gsm8k_problems(smollm2_checkpoint, tmp_path):
    config = (ROOT / "examples" / "rl" / "environment_configs" / "gsm8k.yaml").read_text()
    config = config.replace("examples/rl/environments/gsm8k/gsm8k_sample.jsonl", str(GSM8K_DATA))
    config = config.replace("max_tokens: 256", "max_tokens: 16")
    assert str(GSM8K_DATA) in config and "max_tokens: 16" in config
    envs = tmp_path / "gsm8k.yaml"
    envs.write_text(config)
    output, dump = tmp_path / "eval.json", tmp_path / "dump"
    proc = run(
        "megatron.trainer.evaluate",
        [
            "--hf-checkpoint",
            str(smollm2_checkpoint),
            "--env-config",
            str(envs),
            "--seq-length",
            "512",
            "--inference-max-requests",
            "8",
            "--eval-prompts",
            "4",
            "--eval-samples",
            "2",
            "--eval-pass-k",
            "1",
            "2",
            "--val-dump-dir",
            str(dump),
            "--output-json",
            str(output),
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    numbers = json.loads(output.read_text())
    (env,) = numbers["environments"]
    assert env["env_id"] == "gsm8k" and env["prompts"] == 4 and env["failed"] == 0
    records = read_records(dump / "eval-v0.jsonl")
    assert len(records) == 4 + 4 * 2
    assert_numbers_match_records(numbers, records)
    assert all(r["response_tokens"] <= 16 for r in records)
    print(proc.stdout)
