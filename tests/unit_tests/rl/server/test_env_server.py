"""The env server app, in process: endpoints, equality with in-process agents, fault policy."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from grpo_testing.fakes import RaisingTransport, SeededInference

from megatron.rl.agent.env_config import build_agents
from megatron.rl.http_client import RetryPolicy
from megatron.rl.rollout.faults import FaultLog, run_group
from megatron.rl.server.env_server import EnvServerConfig, create_app
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import GroupedRolloutCall, GroupedRolloutRequest, RolloutGroup

ENVS = [
    {"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}, "weight": 3},
    {"agent_type": "digits", "env_id": "add", "agent_args": {"task": "add"}, "weight": 1},
    {"agent_type": "grpo_testing.fakes:FlakyDigits", "env_id": "flaky", "weight": 1},
]
INFERENCE_URL = "http://trainer:9000"
JSON = "application/json"


def request(batch_id=0, index=0, group_size=4, groups=8) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=batch_id,
        index_in_batch=index,
        groups_in_batch=groups,
        group_size=group_size,
        seed=11,
        submission_policy_version=3,
    )


def call_env_server(requests: list[tuple[str, str, object]], inference=None, envs=ENVS):
    """Run (method, path, json-or-str) calls against a fresh env app; returns the responses."""
    inference = inference or SeededInference()
    tokenizer = inference.tokenizer
    app = create_app(
        build_agents(envs),
        transport=httpx.ASGITransport(create_inference_app(inference, tokenizer)),
    )

    async def run():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://env") as client:
                out = []
                for method, path, body in requests:
                    kwargs = {"json": body}
                    if isinstance(body, str):  # raw text, sent as a JSON client would
                        kwargs = {"content": body, "headers": {"content-type": JSON}}
                    out.append(await client.request(method, path, **kwargs))
                return out

    return asyncio.run(run())


def test_health_lists_the_hosted_environments():
    (response,) = call_env_server([("GET", "/health", None)])
    assert response.status_code == 200
    envs = response.json()["environments"]
    assert [(e["env_id"], e["weight"]) for e in envs] == [("copy", 3), ("add", 1), ("flaky", 1)]


@pytest.mark.parametrize("env_id", ["copy", "add", None])
def test_grouped_rollouts_equal_the_in_process_agent(env_id):
    agents = build_agents(ENVS)
    local_agent = agents if env_id is None else {a.env_id: a for a in agents.agents}[env_id]
    calls = [
        GroupedRolloutCall(request=request(index=i), inference_url=INFERENCE_URL, env_id=env_id)
        for i in range(4)
    ]
    responses = call_env_server(
        [("POST", "/v1/grouped_rollouts", c.model_dump(mode="json")) for c in calls]
    )
    local = [asyncio.run(local_agent.group_rollout(c.request, SeededInference())) for c in calls]
    assert [r.status_code for r in responses] == [200] * 4
    assert [RolloutGroup.model_validate(r.json()) for r in responses] == local


def test_a_raising_environment_gives_the_groups_of_the_in_process_fault_policy(caplog):
    envs = [{"agent_type": "grpo_testing.fakes:RaisingDigits", "env_id": "raising"}]
    calls = [
        GroupedRolloutCall(request=request(b, i), inference_url=INFERENCE_URL, env_id="raising")
        for b in range(3)
        for i in range(5)
    ]
    with caplog.at_level(logging.WARNING, logger="megatron.rl.server.env_server"):
        responses = call_env_server(
            [("POST", "/v1/grouped_rollouts", c.model_dump(mode="json")) for c in calls],
            envs=envs,
        )
    agent, faults = build_agents(envs), FaultLog()
    local = [asyncio.run(run_group(agent, c.request, SeededInference(), faults)) for c in calls]
    remote = [RolloutGroup.model_validate(r.json()) for r in responses]
    assert [r.status_code for r in responses] == [200] * len(calls)
    assert remote == local and sum(g.rollouts[0].is_placeholder for g in remote) == 3
    server_log = [r for r in caplog.records if r.name == "megatron.rl.server.env_server"]
    tracebacks = [r for r in server_log if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1 and "KeyError" in tracebacks[0].getMessage()


def test_generation_requests_carry_rollout_keys_and_seeds_through_http():
    inference = SeededInference()
    call = GroupedRolloutCall(
        request=request(batch_id=5, index=2), inference_url=INFERENCE_URL, env_id="copy"
    )
    call_env_server([("POST", "/v1/grouped_rollouts", call.model_dump(mode="json"))], inference)
    keys = sorted(
        (r.rollout_key.batch_id, r.rollout_key.index_in_batch, r.rollout_key.sample_index)
        for r in inference.requests
    )
    assert keys == [(5, 2, k) for k in range(4)]
    assert len({r.seed for r in inference.requests}) == 4


def test_environment_errors_become_placeholder_rollouts_not_http_errors():
    # Find groups of the flaky env whose problem source fails, and one whose scoring fails.
    calls = [
        GroupedRolloutCall(
            request=request(batch_id=b, group_size=8), inference_url=INFERENCE_URL, env_id="flaky"
        )
        for b in range(30)
    ]
    responses = call_env_server(
        [("POST", "/v1/grouped_rollouts", c.model_dump(mode="json")) for c in calls]
    )
    assert all(r.status_code == 200 for r in responses)
    groups = [RolloutGroup.model_validate(r.json()) for r in responses]
    whole = [g for g in groups if all(r.is_placeholder for r in g.rollouts)]
    partial = [g for g in groups if 0 < sum(r.is_placeholder for r in g.rollouts) < 8]
    assert whole and partial
    assert "problem source failed" in whole[0].rollouts[0].error
    failed = [r for r in partial[0].rollouts if r.is_placeholder]
    assert all("cannot score" in r.error and r.reward == 0.0 for r in failed)


@pytest.mark.parametrize(
    "body, field",
    [
        pytest.param({"inference_url": INFERENCE_URL}, "request", id="missing-request"),
        pytest.param(
            {"request": {"batch_id": -1}, "inference_url": INFERENCE_URL},
            "request.batch_id",
            id="negative-batch-id",
        ),
        pytest.param(
            {"request": request().model_dump(), "inference_url": "ftp://x"},
            "inference_url",
            id="bad-url",
        ),
        pytest.param(
            {"request": request().model_dump(), "inference_url": "http://127.0.0.1:99999"},
            "inference_url",
            id="port-overflow",
        ),
        pytest.param(
            {"request": request().model_dump(), "inference_url": "http://127.0.0.1:P.example"},
            "inference_url",
            id="port-not-a-number",
        ),
        pytest.param(
            {"request": request().model_dump(), "inference_url": INFERENCE_URL, "extra": 1},
            "extra",
            id="unknown-field",
        ),
        pytest.param(
            {
                "request": {**request().model_dump(), "index_in_batch": 9},
                "inference_url": INFERENCE_URL,
            },
            "request",
            id="index-out-of-batch",
        ),
        pytest.param(
            {"request": request().model_dump(), "inference_url": INFERENCE_URL, "env_id": "nope"},
            "env_id",
            id="unknown-env",
        ),
    ],
)
def test_malformed_requests_get_422_naming_the_field(body, field):
    (response,) = call_env_server([("POST", "/v1/grouped_rollouts", body)])
    assert response.status_code == 422
    assert f"field '{field}" in response.json()["detail"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:P.example"])
def test_evaluation_with_a_url_httpx_cannot_call_is_a_422_naming_it(url):
    (response,) = call_env_server([("POST", "/v1/evaluate", {"inference_url": url})])
    assert response.status_code == 422
    assert response.json()["detail"].startswith("field 'inference_url': Value error, ")


def test_invalid_json_is_a_422_naming_the_byte_not_a_field():
    truncated = request().model_dump_json()[:13]
    responses = call_env_server(
        [("POST", "/v1/grouped_rollouts", "{not json"), ("POST", "/v1/evaluate", truncated)]
    )
    details = [r.json()["detail"] for r in responses]
    assert [r.status_code for r in responses] == [422, 422]
    assert details[0].startswith("invalid JSON at byte 1: Expecting property name")
    assert details[1].startswith("invalid JSON at byte 13: ")
    assert not any("field" in d for d in details)


def test_empty_env_id_is_refused_by_the_schema_it_publishes():
    body = {"request": request().model_dump(), "inference_url": INFERENCE_URL, "env_id": ""}
    response, schema = call_env_server(
        [("POST", "/v1/grouped_rollouts", body), ("GET", "/openapi.json", None)]
    )
    assert response.status_code == 422 and "field 'env_id'" in response.json()["detail"]
    schemas = schema.json()["components"]["schemas"]
    for model in ("GroupedRolloutCall", "EvaluationRequest"):
        options = schemas[model]["properties"]["env_id"]["anyOf"]
        assert {"type": "string", "minLength": 1, "maxLength": 256} in options


def test_unreachable_inference_server_is_424_naming_it():
    # Real network, nothing listens on port 9; one quick retry.
    app = create_app(build_agents(ENVS[:1]), EnvServerConfig(retry=RetryPolicy(1, 0.01)))

    async def run():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://env", timeout=30
            ) as client:
                call = GroupedRolloutCall(request=request(), inference_url="http://127.0.0.1:9")
                return await client.post("/v1/grouped_rollouts", json=call.model_dump(mode="json"))

    response = asyncio.run(run())
    assert response.status_code == 424
    detail = response.json()["detail"]
    assert "http://127.0.0.1:9" in detail and "after 2 attempts" in detail


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(httpx.InvalidURL, id="invalid-url"),
        pytest.param(httpx.DecodingError, id="decoding"),
        pytest.param(httpx.StreamConsumed, id="stream"),
        pytest.param(httpx.RemoteProtocolError, id="protocol"),
        pytest.param(
            ExceptionGroup("unhandled errors in a TaskGroup", [OverflowError("port 0-65535")]),
            id="exception-group",
        ),
    ],
)
def test_an_inference_call_that_httpx_fails_is_a_424_naming_the_server_not_placeholders(error):
    config = EnvServerConfig(retry=RetryPolicy(1, 0.001))
    app = create_app(build_agents(ENVS[:1]), config, transport=RaisingTransport(error))

    async def run():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://env") as client:
                call = GroupedRolloutCall(request=request(), inference_url=INFERENCE_URL)
                return await client.post("/v1/grouped_rollouts", json=call.model_dump(mode="json"))

    response = asyncio.run(run())
    assert response.status_code == 424, response.text
    assert f"inference server {INFERENCE_URL}" in response.json()["detail"]


def test_evaluation_scores_each_environment():
    body = {"inference_url": INFERENCE_URL, "num_problems": 6, "seed": 3}
    (response,) = call_env_server([("POST", "/v1/evaluate", body)])
    assert response.status_code == 200
    results = {r["env_id"]: r for r in response.json()["results"]}
    assert set(results) == {"copy", "add", "flaky"}
    assert all(r["num_problems"] == 6 and 0 <= r["reward_mean"] <= 1 for r in results.values())


def test_evaluation_requests_do_not_enter_the_training_schedule():
    inference = SeededInference()
    call_env_server(
        [
            (
                "POST",
                "/v1/evaluate",
                {"inference_url": INFERENCE_URL, "env_id": "copy", "num_problems": 3},
            )
        ],
        inference,
    )
    assert len(inference.requests) == 3
    assert all(r.rollout_key is None for r in inference.requests)
    assert all(r.sampling.temperature == 0.0 for r in inference.requests)


def test_evaluation_only_environments_are_hosted_and_evaluated_with_weight_0():
    envs = [
        ENVS[0],
        {"agent_type": "digits", "env_id": "sort", "agent_args": {"task": "sort"}, "weight": 0},
        {"agent_type": "digits", "env_id": "rev", "evaluation_only": True},
    ]
    call = GroupedRolloutCall(request=request(), inference_url=INFERENCE_URL, env_id="rev")
    health, evaluation, group = call_env_server(
        [
            ("GET", "/health", None),
            ("POST", "/v1/evaluate", {"inference_url": INFERENCE_URL, "num_problems": 2}),
            ("POST", "/v1/grouped_rollouts", call.model_dump(mode="json")),
        ],
        envs=envs,
    )
    listed = [(e["env_id"], e["weight"]) for e in health.json()["environments"]]
    assert listed == [("copy", 3), ("sort", 0), ("rev", 0)]
    assert [r["env_id"] for r in evaluation.json()["results"]] == ["copy", "sort", "rev"]
    assert group.status_code == 200 and group.json()["rollouts"][0]["env_id"] == "rev"


def test_openapi_schema_is_served():
    (response,) = call_env_server([("GET", "/openapi.json", None)])
    paths = response.json()["paths"]
    assert {"/health", "/v1/grouped_rollouts", "/v1/evaluate"} <= set(paths)
