"""Routing replay: record the experts each MoE router chose, and route by a record.

An MoE policy's inference engine and trainer compute the same router logits to float rounding,
but a top-k over near-equal logits flips with rounding: a token then goes to other experts in the
trainer than the ones that produced its sampled logprob, and the importance ratio of that token
is no longer a ratio of the same function. Rollout routing replay ("R3") records the engine's
choice for every token it feeds and makes the trainer's forwards route each recorded position
the same way (the gate weights are still the trainer's own softmax over those experts, so the
router keeps its gradient).

The seam is megatron-core's: ``topk_routing_with_score_function`` hands its top-k to
``router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)``.
``RoutingReplay`` implements that method; ``routing_replays(model)`` puts one on each router.

A route is (k,) expert ids per token and MoE layer; a model's routes are (tokens, L, k) with L
its routers in ``model.modules()`` order. Router rows are the model's tokens sequence-major: a
(b, s) input gives rows ``s * b_size + b`` (megatron-core's [s, b] activations, flattened).
"""

from __future__ import annotations

import torch

from megatron.rl.models.moe import CPUSafeRouter

ROUTING_MODES = ("off", "measure", "replay")
"""What a policy's forwards do with the routes recorded by the engine: nothing, compare
(``routing_mismatch``), or compare and route by them."""

__all__ = [
    "ROUTING_MODES",
    "RoutingReplay",
    "clear_routing",
    "clear_targets",
    "configure_routing",
    "recorded_routes",
    "routing_mismatch",
    "routing_replays",
    "set_routing_targets",
    "start_recording",
    "stop_recording",
]


class RoutingReplay:
    """One router's record, target and mismatch count (megatron-core's ``router_replay``
    seam)."""

    def __init__(self) -> None:
        self.mode = "off"
        """``ROUTING_MODES``: what ``set_routing_targets`` does with a model's record."""
        self.record = False
        """Keep the top-k of each forward in ``recorded``."""
        self.recorded: torch.Tensor | None = None
        """(rows, k) int64 experts the last forward routed to (when ``record``; replayed ones
        included)."""
        self.target: torch.Tensor | None = None
        """(rows, k) int64 experts to compare with (and, with ``replay``, to route by); a row of
        -1 has no record and keeps the router's own choice."""
        self.replay = False
        """Route the recorded rows of ``target`` by it instead of the router's own top-k."""
        self.differs: list[torch.Tensor] = []
        """Per forward with a target: (rows,) bool, the row's own top-k set differs from it."""
        self.known: list[torch.Tensor] = []
        """Per forward with a target: (rows,) bool, the row has a record."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, k) top-k scores and expert ids: the router's own, or the target's where it has
        a record and ``replay`` is on (scores gathered at those experts)."""
        values, indices = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )  # (rows, k) each
        target = self.target
        if target is None:
            if self.record:
                self.recorded = indices.detach()
            return values, indices
        if target.shape != indices.shape:
            raise ValueError(
                f"routing replay: the record has shape {tuple(target.shape)} (rows, k) but the "
                f"router routes {tuple(indices.shape)}"
            )
        target = target.to(indices.device)
        known = target[:, 0] >= 0  # (rows,)
        same = (indices.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
        self.known.append(known.cpu())
        self.differs.append((known & ~same).cpu())
        if self.replay:
            indices = torch.where(known[:, None], target, indices)  # (rows, k)
            values = scores.gather(1, indices)
        if self.record:  # the experts the forward used
            self.recorded = indices.detach()
        return values, indices


def routing_replays(model: torch.nn.Module) -> list[RoutingReplay]:
    """The ``RoutingReplay`` of each of ``model``'s routers, in layer order (attached on first
    use; [] for a dense model)."""
    replays = []
    for module in model.modules():
        if isinstance(module, CPUSafeRouter):
            if not isinstance(module.router_replay, RoutingReplay):
                module.router_replay = RoutingReplay()
            replays.append(module.router_replay)
    return replays


def start_recording(model: torch.nn.Module) -> None:
    """Make each router of ``model`` keep the top-k of its forwards (``recorded_routes``)."""
    for replay in routing_replays(model):
        replay.record, replay.recorded = True, None


def stop_recording(model: torch.nn.Module) -> None:
    """Make ``model``'s routers stop keeping their top-k and drop the last record."""
    for replay in routing_replays(model):
        replay.record, replay.recorded = False, None


def recorded_routes(model: torch.nn.Module) -> torch.Tensor | None:
    """(rows, L, k) int16 experts of the last forward of every router (rows: the forward's tokens
    sequence-major); None for a dense model or before a recorded forward."""
    recorded = [r.recorded for r in routing_replays(model)]
    if not recorded or any(r is None for r in recorded):
        return None
    return torch.stack(recorded, dim=1).to(torch.int16)  # (rows, L, k)


def configure_routing(model: torch.nn.Module, mode: str) -> None:
    """Give ``model``'s forwards the ``ROUTING_MODES`` ``mode`` for the routes they are handed
    (``set_routing_targets``)."""
    if mode not in ROUTING_MODES:
        raise ValueError(f"routing mode must be one of {ROUTING_MODES}, got {mode!r}")
    for r in routing_replays(model):
        r.mode = mode


def set_routing_targets(model: torch.nn.Module, routes: torch.Tensor | None) -> None:
    """Hand the next forwards of ``model`` the recorded ``routes``: (r, s, L * k) or
    (r, s, L, k) expert ids laid out as the model's (r, s) input, -1 where nothing was recorded;
    None: no record. What the forwards do with them is the model's mode (``configure_routing``):
    nothing (``off``), compare (``measure``), or compare and route by them (``replay``). The
    targets stay until the next call (a recomputed forward sees them too)."""
    replays = routing_replays(model)
    mode = replays[0].mode if replays else "off"
    if routes is None or mode == "off":
        for r in replays:
            r.target, r.replay = None, False
        return
    layers = len(replays)
    if routes.dim() == 3:
        if routes.shape[-1] % layers:
            raise ValueError(
                f"routing replay: a route of {routes.shape[-1]} experts does not split over the "
                f"model's {layers} MoE layers"
            )
        routes = routes.unflatten(-1, (layers, routes.shape[-1] // layers))
    rows, width, recorded_layers, k = routes.shape
    if recorded_layers != layers:
        raise ValueError(
            f"routing replay: the routes record {recorded_layers} MoE layers, the model has "
            f"{layers}"
        )
    flat = routes.transpose(0, 1).reshape(width * rows, layers, k).long()  # (s * r, L, k)
    for layer, r in enumerate(replays):
        r.target, r.replay = flat[:, layer], mode == "replay"


def routing_mismatch(model: torch.nn.Module) -> tuple[int, int]:
    """(tokens whose own routing differs from the record in some layer, tokens with a record)
    over the forwards since the last call; clears the counts."""
    replays = routing_replays(model)
    if not replays or not replays[0].known:
        for r in replays:
            r.known, r.differs = [], []
        return 0, 0
    differing = compared = 0
    for forward in range(len(replays[0].known)):
        known = replays[0].known[forward]
        differs = torch.stack([r.differs[forward] for r in replays]).any(dim=0)  # (rows,)
        differing += int(differs.sum())
        compared += int(known.sum())
    for r in replays:
        r.known, r.differs = [], []
    return differing, compared


def clear_routing(model: torch.nn.Module) -> None:
    """Stop recording, comparing and replaying on every router of ``model`` (its mode stays)."""
    stop_recording(model)
    clear_targets(model)


def clear_targets(model: torch.nn.Module) -> None:
    """Forget the routes handed to ``model``'s forwards (``set_routing_targets``) and the
    mismatch counts; recording (the engine's) is left as it is."""
    for r in routing_replays(model):
        r.target, r.replay, r.known, r.differs = None, False, [], []
