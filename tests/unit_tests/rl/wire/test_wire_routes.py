"""Routing replay's records on the wire: ``InferenceResponse.routed_experts`` (one entry per fed
position) and ``TokenRollout.routed_experts`` (one per input position), checked naming the field,
omitted from the JSON when absent."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_wire import token_rollout

from megatron.rl.wire import InferenceResponse


def inference_response(**overrides) -> InferenceResponse:
    fields = dict(
        prompt_tokens=[3, 4],
        tokens=[5, 1],
        text="5",
        logprobs=[-0.1, -0.2],
        policy_versions=[0, 0],
        finish_reason="stop",
    )
    fields.update(overrides)
    return InferenceResponse(**fields)


ROUTES = [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1]]
"""Three positions of 2 layers x top-2 experts."""


@pytest.mark.parametrize(
    "make, routes, needle",
    [
        pytest.param(
            inference_response,
            ROUTES[:2],
            "'routed_experts' must have one entry per fed position (3), got 2",
            id="response-short",
        ),
        pytest.param(
            inference_response,
            [[0, 1, 2, 3], [1, 2], [2, 3, 0, 1]],
            "'routed_experts' entries must all have one length",
            id="response-ragged",
        ),
        pytest.param(
            token_rollout,
            ROUTES * 2,
            "'routed_experts' must have one entry per input position (5), got 6",
            id="rollout-long",
        ),
        pytest.param(
            token_rollout,
            ROUTES + [[0, 1], [1, 0]],
            "'routed_experts' entries must all have one length",
            id="rollout-ragged",
        ),
        pytest.param(token_rollout, [[0, -1, 2, 3]] * 5, "routed_experts", id="negative-expert"),
        pytest.param(token_rollout, [[]] * 5, "routed_experts", id="empty-route"),
    ],
)
def test_routed_experts_are_checked_naming_the_field(make, routes, needle):
    with pytest.raises(ValidationError) as info:
        make(routed_experts=routes)
    assert needle in str(info.value)


def test_routed_experts_survive_json_and_are_omitted_when_absent():
    for make, routes in ((inference_response, ROUTES), (token_rollout, ROUTES + ROUTES[:2])):
        plain = make()
        assert plain.routed_experts is None and "routed_experts" not in plain.model_dump_json()
        routed = make(routed_experts=routes)
        assert type(routed).model_validate_json(routed.model_dump_json()) == routed
