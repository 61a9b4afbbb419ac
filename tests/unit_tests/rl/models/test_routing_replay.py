"""Routing replay on a tiny MoE GPT: a recorded forward's routes, replayed, reproduce its routing
and logits; a record that disagrees is counted as a mismatch and, replayed, routes by it."""

from __future__ import annotations

import pytest
import torch
from test_moe import MOE, batch, build

from megatron.rl.models.routing_replay import (
    clear_routing,
    configure_routing,
    recorded_routes,
    routing_mismatch,
    set_routing_targets,
    start_recording,
)


def routes_as_input(recorded: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """(s * b, L, k) router rows -> (b, s, L, k) laid out as the input."""
    return recorded.view(s, b, *recorded.shape[1:]).transpose(0, 1)


def test_recorded_routes_have_one_row_per_token_and_layer(single_rank_world):
    model = build(MOE).eval()
    ids, pos = batch()
    start_recording(model)
    with torch.no_grad():
        model(ids, pos, None)
    routes = recorded_routes(model)
    assert routes.shape == (12 * 3, 2, 2) and routes.dtype == torch.int16
    assert int(routes.min()) >= 0 and int(routes.max()) < 4
    assert (routes[..., 0] != routes[..., 1]).all()  # k distinct experts


def test_replaying_own_routes_changes_nothing_and_counts_no_mismatch(single_rank_world):
    model = build(MOE).eval()
    ids, pos = batch()
    start_recording(model)
    with torch.no_grad():
        free = model(ids, pos, None)
    routes = routes_as_input(recorded_routes(model), 3, 12)
    clear_routing(model)
    configure_routing(model, "replay")
    set_routing_targets(model, routes)
    with torch.no_grad():
        replayed = model(ids, pos, None)
    assert torch.equal(free, replayed)
    assert routing_mismatch(model) == (0, 36)
    assert routing_mismatch(model) == (0, 0)  # counts cleared


def test_a_different_record_is_a_mismatch_and_replay_routes_by_it(single_rank_world):
    model = build(MOE).eval()
    ids, pos = batch()
    start_recording(model)
    with torch.no_grad():
        free = model(ids, pos, None)
    routes = routes_as_input(recorded_routes(model), 3, 12).clone()
    clear_routing(model)
    routes[1, 5, 0] = (routes[1, 5, 0] + 1) % 4  # another expert pair, layer 0
    routes[1, 5, 0, 1] = torch.where(
        routes[1, 5, 0, 1] == routes[1, 5, 0, 0], (routes[1, 5, 0, 1] + 1) % 4, routes[1, 5, 0, 1]
    )
    routes[2, 7:] = -1  # unrecorded positions keep the router's own choice
    configure_routing(model, "measure")
    set_routing_targets(model, routes)
    with torch.no_grad():
        measured = model(ids, pos, None)
    assert torch.equal(free, measured)  # measuring does not change the routing
    assert routing_mismatch(model) == (1, 36 - 5)
    configure_routing(model, "replay")
    set_routing_targets(model, routes)
    with torch.no_grad():
        replayed = model(ids, pos, None)
    changed = (replayed - free).abs().amax(dim=-1) > 0  # (b, s)
    assert changed[1, 5] and changed[1, 5:].all()  # the token and, through attention, after it
    assert not changed[0].any() and not changed[2].any() and not changed[1, :5].any()


def test_routes_for_another_layer_count_are_refused(single_rank_world):
    model = build(MOE)
    configure_routing(model, "replay")
    with pytest.raises(ValueError, match="record 3 MoE layers, the model has 2"):
        set_routing_targets(model, torch.zeros(1, 4, 3, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="5 experts does not split over the model's 2"):
        set_routing_targets(model, torch.zeros(1, 4, 5, dtype=torch.int16))


def test_off_ignores_the_record_and_flat_routes_equal_per_layer_routes(single_rank_world):
    model = build(MOE).eval()
    ids, pos = batch()
    start_recording(model)
    with torch.no_grad():
        model(ids, pos, None)
    routes = routes_as_input(recorded_routes(model), 3, 12)
    configure_routing(model, "off")
    set_routing_targets(model, routes)
    with torch.no_grad():
        model(ids, pos, None)
    assert routing_mismatch(model) == (0, 0)  # nothing compared
    configure_routing(model, "measure")
    set_routing_targets(model, routes.flatten(-2))  # (b, s, L * k)
    with torch.no_grad():
        model(ids, pos, None)
    assert routing_mismatch(model) == (0, 36)
    with pytest.raises(ValueError, match="routing mode must be one of"):
        configure_routing(model, "always")
