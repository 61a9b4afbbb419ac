"""``agent_type: reward_model`` (and ``function: reward_model``): a tiny random
``AutoModelForSequenceClassification`` made here scores each group's completions in batches on
its own worker thread, as transformers does one text at a time; in process and behind the env
server alike; a model directory that cannot be read stops the config's load naming the field."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import httpx
import pytest
import torch
import transformers
from grpo_testing.fakes import SeededInference

from megatron.rl.agent.api import RewardSourceError
from megatron.rl.agent.env_config import EnvConfigError, build_agents
from megatron.rl.models.hf.tiny import make_tiny_reward_model
from megatron.rl.server.env_server import create_app
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import GroupedRolloutCall, GroupedRolloutRequest, RolloutGroup

PROMPTS = ["12+3=", "40*2=", "7-5=", "314, 15: "]  # the character tokenizer's alphabet


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A one-label and a two-label tiny reward model, and a prompts file."""
    root = tmp_path_factory.mktemp("reward_models")
    one = make_tiny_reward_model(root / "rm1", seed=1)
    two = make_tiny_reward_model(root / "rm2", num_labels=2, seed=2)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "reference": "1"}) + "\n" for p in PROMPTS))
    return one, two, prompts


def rm_entry(model_dir, prompts, **args) -> dict:
    return {
        "agent_type": "reward_model",
        "env_id": "rm",
        "agent_args": {"model_dir": str(model_dir), "prompts": {"path": str(prompts)}, **args},
    }


def request(batch_id: int = 0, index: int = 0, group_size: int = 5) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=batch_id,
        index_in_batch=index,
        groups_in_batch=4,
        group_size=group_size,
        seed=3,
        submission_policy_version=1,
    )


def run(config: list[dict], requests: list[GroupedRolloutRequest]):
    """The groups of ``requests`` (and the agent) of the config's first environment."""
    agent = build_agents(config).agents[0]

    async def go():
        await agent.astart()
        try:
            return [await agent.group_rollout(r, SeededInference()) for r in requests]
        finally:
            await agent.aclose()

    return asyncio.run(go()), agent


def transformers_scores(model_dir, texts: list[str], chat: bool) -> torch.Tensor:
    """(N, labels) logits of each text alone, straight from transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat)
            rows.append(model(**ids).logits[0])
    return torch.stack(rows)


def test_scores_are_the_models_computed_in_batches_on_a_worker_thread(models):
    model_dir, _, prompts = models
    requests = [request(0, i) for i in range(3)]
    groups, agent = run([rm_entry(model_dir, prompts, batch_size=2)], requests)
    scorer = agent.reward_functions.functions[0].function.model
    assert scorer.forward_sizes == [2, 2, 1] * 3  # each group of 5 in batches of 2
    assert len(scorer.threads) == 1 and threading.get_ident() not in scorer.threads
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    rollouts = [r for g in groups for r in g.rollouts]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r.prompt}, {"role": "assistant", "content": r.completion}],
            tokenize=False,
        )
        for r in rollouts
    ]  # format auto: the model's tokenizer has a chat template
    expected = transformers_scores(model_dir, texts, chat=True)[:, 0]
    assert all(
        r.error is None and r.reward_components == {"reward_model": r.reward} for r in rollouts
    )
    assert [r.reward for r in rollouts] == pytest.approx(expected.tolist(), abs=1e-5)
    assert len({round(r.reward, 6) for r in rollouts}) > 3  # a real score, not a constant
    one_at_a_time, _ = run([rm_entry(model_dir, prompts, batch_size=1)], requests)
    alone = [r.reward for g in one_at_a_time for r in g.rollouts]
    assert alone == pytest.approx([r.reward for r in rollouts], abs=1e-5)


def test_the_event_loop_runs_while_the_model_scores(models):
    model_dir, _, prompts = models
    (agent,) = build_agents([rm_entry(model_dir, prompts, batch_size=1)]).agents

    async def go():
        await agent.astart()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        group = await agent.group_rollout(request(group_size=16), SeededInference())
        task.cancel()
        await agent.aclose()
        return group, ticks

    group, ticks = asyncio.run(go())
    assert all(r.error is None for r in group.rollouts)
    assert ticks > 16  # the loop kept running through 16 forward passes


@pytest.mark.parametrize(
    "args, pick",
    [
        pytest.param({"transform": "sigmoid"}, lambda x: torch.sigmoid(x[:, 0]), id="sigmoid"),
        pytest.param(
            {
                "transform": "softmax",
                "label_index": 1,
                "format": "plain",
                "plain_template": "Q: {prompt} A: {completion}",
            },
            lambda x: torch.softmax(x, -1)[:, 1],
            id="softmax-plain",
        ),
        pytest.param({"label_index": 1}, lambda x: x[:, 1], id="logit-label-1"),
    ],
)
def test_transforms_labels_and_plain_format(models, args, pick):
    _, model_dir, prompts = models
    (group,), _ = run([rm_entry(model_dir, prompts, **args)], [request(group_size=4)])
    template = args.get("plain_template")
    if template is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        texts = [
            tokenizer.apply_chat_template(
                [
                    {"role": "user", "content": r.prompt},
                    {"role": "assistant", "content": r.completion},
                ],
                tokenize=False,
            )
            for r in group.rollouts
        ]
    else:
        texts = [template.format(prompt=r.prompt, completion=r.completion) for r in group.rollouts]
    expected = pick(transformers_scores(model_dir, texts, chat=template is None))
    assert [r.reward for r in group.rollouts] == pytest.approx(expected.tolist(), abs=1e-5)


def test_the_env_server_scores_as_the_in_process_environment(models):
    model_dir, _, prompts = models
    config = [rm_entry(model_dir, prompts, batch_size=3)]
    calls = [
        GroupedRolloutCall(request=request(b, i), inference_url="http://trainer:9", env_id="rm")
        for b in range(2)
        for i in range(2)
    ]
    inference = SeededInference()
    app = create_app(
        build_agents(config),
        transport=httpx.ASGITransport(create_inference_app(inference, inference.tokenizer)),
    )

    async def serve():
        async with app.router.lifespan_context(app):  # loads the model (astart)
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://env") as client:
                health = await client.get("/health")
                answers = [
                    await client.post("/v1/grouped_rollouts", json=c.model_dump(mode="json"))
                    for c in calls
                ]
                return health, answers

    health, answers = asyncio.run(serve())
    assert health.json()["environments"] == [
        {"env_id": "rm", "agent_type": "PromptsEnvironment", "weight": 1.0}
    ]
    assert [a.status_code for a in answers] == [200] * len(calls)
    remote = [RolloutGroup.model_validate(a.json()) for a in answers]
    local, _ = run(config, [c.request for c in calls])
    assert remote == local
    assert all(set(r.reward_components) == {"reward_model"} for g in remote for r in g.rollouts)


def test_a_task_s_prompts_scored_by_the_model_and_more_reward_funcs(models, monkeypatch):
    """``task``: the math example's problems (and its held-out split), the model's score as
    ``environment`` in a weighted sum with a regex."""
    from megatron.rl.agent.dataset import DatasetEnvironment
    from megatron.rl.agent.rewards.functions import WeightedRewards

    model_dir, _, _ = models
    task = {
        "agent_type": "examples.rl.environments.math:MathEnvironment",
        "agent_args": {"path": "examples/rl/environments/math/tiny_arithmetic.jsonl"},
    }
    config = {
        "agent_type": "reward_model",
        "env_id": "math-rm",
        "agent_args": {"model_dir": str(model_dir), "task": task},
        "reward_funcs": [
            {"function": "environment", "name": "rm", "weight": 0.5},
            {"function": "regex", "args": {"pattern": "^[0-9]+$"}},
        ],
    }
    (agent,) = build_agents([config]).agents
    assert type(agent).__name__ == "MathEnvironment" and agent.env_id == "math-rm"
    assert isinstance(agent, DatasetEnvironment) and isinstance(
        agent.reward_functions, WeightedRewards
    )
    agent.hold_out(0.25)  # --val-split-fraction works on the task
    (group,), _ = run([config], [request(group_size=4)])
    for r in group.rollouts:
        c = r.reward_components
        assert set(c) == {"rm", "regex"} and r.reward == pytest.approx(0.5 * c["rm"] + c["regex"])
        assert r.problem_id.startswith("tiny_arithmetic.jsonl:")


UNREADABLE_DIRS = {  # id: (the model_dir given, what the message says)
    "missing": (lambda d, tmp: str(tmp / "missing"), "is not a local directory"),
    "hub-id": (
        lambda d, tmp: "some-org/some-rm",
        "'some-org/some-rm' is not a local directory (nothing is downloaded: fetch a Hub "
        "model first, e.g. `hf download some-org/some-rm --local-dir DIR`, and give DIR)",
    ),
    "no-config": (lambda d, tmp: _without(d, tmp, "config.json"), "has no config.json"),
    "no-weights": (lambda d, tmp: _without(d, tmp, "model.safetensors"), "has no weights"),
    "bad-config": (lambda d, tmp: _corrupt(d, tmp, "config.json"), "cannot read config.json"),
    "no-tokenizer": (
        lambda d, tmp: _without(d, tmp, "tokenizer.json", "tokenizer_config.json"),
        "cannot load its tokenizer",
    ),
}


@pytest.mark.parametrize("make, message", UNREADABLE_DIRS.values(), ids=UNREADABLE_DIRS)
def test_an_unreadable_model_dir_is_one_message_naming_the_field(models, tmp_path, make, message):
    model_dir, _, prompts = models
    bad = make(model_dir, tmp_path)
    with pytest.raises(EnvConfigError) as info:
        build_agents([rm_entry(bad, prompts)])
    text = str(info.value)
    assert text.startswith(
        "env config <default>, entry 0 (agent_type 'reward_model'): field 'agent_args.model_dir': "
    )
    assert message in text and text.count("field '") == 1 and "\n" not in text
    funcs = {
        "agent_type": "digits",
        "reward_funcs": [
            {"function": "environment"},
            {"function": "reward_model", "args": {"model_dir": str(bad)}},
        ],
    }
    with pytest.raises(EnvConfigError, match=r"field 'reward_funcs\.1\.args\.model_dir': "):
        build_agents([funcs])


def _without(model_dir, tmp, *names):
    copy = shutil.copytree(model_dir, tmp / "copy")
    for name in names:
        (copy / name).unlink()
    return copy


def _corrupt(model_dir, tmp, name):
    copy = shutil.copytree(model_dir, tmp / "copy")
    (copy / name).write_text("{not json")
    return copy


MISFITS = {  # id: (agent_args given, the field named, what the message says)
    "label": ({"label_index": 1}, "label_index", "the reward model has 1 label(s)"),
    "softmax": ({"transform": "softmax"}, "transform", "softmax needs a model with two labels"),
    "template": ({"plain_template": "{prompt}"}, "plain_template", "must contain '{completion}'"),
    "device": ({"device": "gpu:0"}, "device", "not a torch device"),
    "source": ({"prompts": None}, "agent_args", "give exactly one of 'prompts'"),
}


@pytest.mark.parametrize("args, field, message", MISFITS.values(), ids=MISFITS)
def test_options_that_do_not_fit_the_model_name_their_field(models, args, field, message):
    model_dir, _, prompts = models
    config = rm_entry(model_dir, prompts)
    config["agent_args"].update(args)
    with pytest.raises(EnvConfigError) as info:
        build_agents([config])
    where = field if field == "agent_args" else f"agent_args.{field}"
    assert f"field '{where}'" in str(info.value) and message in str(info.value)


def test_weights_that_do_not_load_stop_the_start_naming_the_environment_and_field(models, tmp_path):
    model_dir, _, prompts = models
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    (agent,) = build_agents([rm_entry(broken, prompts)]).agents  # the checks read no weights
    with pytest.raises(RewardSourceError) as info:
        asyncio.run(agent.astart())
    assert str(info.value).startswith(
        f"environment 'rm': field 'agent_args.model_dir' ({broken}): cannot load the reward model: "
    )
    from megatron.trainer.runtime.exits import expected_errors

    assert isinstance(info.value, expected_errors())  # one message, no traceback


def test_the_env_server_cli_refuses_an_unreadable_model_dir_with_one_line(models, tmp_path, capsys):
    from megatron.rl.server.env_server import main

    _, _, prompts = models
    config = tmp_path / "envs.yaml"
    config.write_text(json.dumps([rm_entry(tmp_path / "no-such-model", prompts)]))  # YAML
    with pytest.raises(SystemExit) as exc:
        main(["--env-config", str(config)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"env_server: error: --env-config: env config {config}, entry 0 ")
    assert "field 'agent_args.model_dir'" in err and "is not a local directory" in err


def test_the_trainer_refuses_an_unreadable_model_dir_with_one_message(models, tmp_path):
    from megatron.trainer.errors import UsageError
    from megatron.trainer.flags.parse import check
    from megatron.trainer.grpo import load_agent

    _, _, prompts = models
    config = tmp_path / "envs.yaml"
    config.write_text(json.dumps([rm_entry(tmp_path / "no-such-model", prompts)]))
    cfg, errors = check(["--env-config", str(config)])
    assert errors == []
    with pytest.raises(UsageError) as info:
        load_agent(cfg)
    assert info.value.code == 2 and "\n" not in info.value.message
    assert info.value.message.startswith("pretrain_grpo.py: error: --env-config: env config ")
    assert "field 'agent_args.model_dir'" in info.value.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_a_cuda_device_without_cuda_stops_the_start_naming_the_field(models):
    model_dir, _, prompts = models
    (agent,) = build_agents([rm_entry(model_dir, prompts, device="cuda:0")]).agents
    with pytest.raises(
        RewardSourceError,
        match=r"^environment 'rm': field 'agent_args\.device': cuda:0: CUDA is not available$",
    ):
        asyncio.run(agent.astart())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scores_on_a_gpu_equal_the_cpu_s(models):
    model_dir, _, prompts = models
    requests = [request(0, i) for i in range(2)]
    on_cpu, _ = run([rm_entry(model_dir, prompts)], requests)
    on_gpu, agent = run([rm_entry(model_dir, prompts, device="cuda")], requests)
    scorer = agent.reward_functions.functions[0].function.model
    assert scorer.forward_sizes == [5, 5]
    cpu = [r.reward for g in on_cpu for r in g.rollouts]
    assert [r.reward for g in on_gpu for r in g.rollouts] == pytest.approx(cpu, abs=1e-4)
