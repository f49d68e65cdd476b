"""Rollout routing replay (R3) and the router statistics of a training forward.

A forward's MoE routers see its tokens flattened in the engine's layout: rows of the right-padded
[B, T] batch, the packed rows (``engines.fsdp.packing``), or megatron's sequence-first [T, B]. The
engine lays the rollout's routes out the same way (``place``) and makes them current for the
forward (``feeding``). Each router, patched once (``patch_hf``, ``patch_mcore``), computes its
own top-k and then asks ``choose(layer, own)`` which experts to use:

- replay on and the token recorded: the rollout's experts e_1..e_k. The gate weights come from
  the same router probabilities, gathered at those experts (HF: p = softmax(logits over every
  expert), w_i = p[e_i] / sum_j p[e_j] with ``norm_topk_prob``; mcore: softmax over the k
  chosen logits, the same numbers), so the router still learns through them;
- otherwise its own top-k. Positions without a recorded route are padding and each sample's
  last token, whose output no log-prob reads.

Router objectives (``algos.router_loss``, per mini-batch: ``Engine.train_step``'s ``router``,
held by ``objective``): each router adds its layer's share of this forward's tokens to the
gradient by attaching it to its gate weights (``_Attach``: the identity forward, and the
term's gradient injected in backward, as mcore's ``MoEAuxLossAutoScaler``), so the term follows
the gate weights through activation checkpointing (a recomputed router attaches again; the
forward whose graph is backpropagated injects once).

Statistics, counted once per layer and forward (a backward's recompute does not count again):

    router_agreement     = #(token, layer) with {own top-k} = {rollout's} / #(token, layer) recorded
    routes_differ_tokens = #tokens whose sets differ in at least one layer / #tokens recorded
    expert_load_max_mean = mean over layers of max_e load[l, e] / mean_e load[l, e],
                           load = real tokens routed to expert e by the experts used
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from spmd_rl.algos import router_loss


@dataclass
class Feed:
    routes: torch.Tensor | None
    """[N, layers, k] int64 in the forward's layout, -1 where no route was recorded; None: no routes."""
    valid: torch.Tensor
    """[N] bool, real tokens."""
    replay: bool
    seen: set = field(default_factory=set)
    differ: torch.Tensor | None = None


@dataclass
class RouterObjective:
    """One mini-batch's router terms (``algos.router_loss``): coefficients, the load fractions
    f [layers, experts] (rows sum to 1; None without load balancing), the mini-batch's real
    tokens T over every DP rank, and ``scale``: the factor the stage's loss carries (the DP size
    that undoes the gradient average)."""

    aux_coef: float
    z_coef: float
    fractions: torch.Tensor | None
    tokens: float
    layers: int
    scale: float


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_shape = term.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.term_shape, device=grad.device, dtype=torch.float32)


_current: Feed | None = None
_objective: RouterObjective | None = None
_sums: dict[str, torch.Tensor] = {}
_experts: dict[int, int] = {}
"""Experts per patched layer."""


def place(
    lengths: list[int],
    size: int,
    index: Callable[[int, torch.Tensor], torch.Tensor],
    routes: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(routes [size, layers, k] int64, -1 where none; valid [size] bool) of a forward whose
    sample b's position t sits at row ``index(b, t)`` (t a tensor of positions)."""
    valid = torch.zeros(size, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[index(b, torch.arange(n))] = True
    if routes is None:
        return None, valid
    shape = routes[0].shape[1:] if routes else (0, 0)
    out = torch.full((size, *shape), -1, dtype=torch.long)
    for b, r in enumerate(routes):
        out[index(b, torch.arange(r.shape[0]))] = r.long()
    return out, valid


def start(routes: torch.Tensor | None, valid: torch.Tensor, replay: bool, device: torch.device | str = "cpu") -> None:
    """Make ``routes`` / ``valid`` (``place``) current until ``stop`` or the next ``start``:
    for a micro-batch's forward and its backward (which recomputes the forward under
    activation checkpointing, and must replay the same experts). Both are copied to the
    routers' ``device`` here, once per micro-batch, not once per layer."""
    global _current
    stop()
    _current = Feed(
        None if routes is None else routes.to(device, non_blocking=True), valid.to(device, non_blocking=True), replay
    )


def stop() -> None:
    global _current
    if _current is not None and _current.differ is not None:
        _add("differ_tokens", _current.differ.sum())
    _current = None


@contextlib.contextmanager
def feeding(routes: torch.Tensor | None, valid: torch.Tensor, replay: bool, device: torch.device | str = "cpu"):
    """``start`` ... ``stop`` around the block."""
    start(routes, valid, replay, device)
    try:
        yield
    finally:
        stop()


def choose(layer: int, own: torch.Tensor) -> torch.Tensor:
    """The experts [N, k] a router uses (module docstring); counts the statistics."""
    f = _current
    if f is None:
        return own
    routes = None if f.routes is None else f.routes[:, layer].to(own.device)
    recorded = None if routes is None else routes[:, 0] >= 0
    if layer not in f.seen:
        f.seen.add(layer)
        _count(f, layer, own, routes, recorded)
    if f.replay and routes is not None:
        return torch.where(recorded[:, None], routes, own)
    return own


@contextlib.contextmanager
def objective(router: RouterObjective | None):
    """The router terms of the training forwards inside the block (None: none): an engine's
    ``train_step`` holds it around its micro-batches, restoring the previous one after."""
    global _objective
    before, _objective = _objective, router
    try:
        yield
    finally:
        _objective = before


def attach(layer: int, logits: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights`` carrying this layer's router terms of the current forward (module docstring);
    unchanged outside a training forward with an objective set."""
    f, obj = _current, _objective
    if f is None or obj is None or not torch.is_grad_enabled():
        return weights
    valid = f.valid.to(logits.device)
    term = torch.zeros((), device=logits.device)
    key = ("objective", layer)
    if obj.aux_coef and obj.fractions is not None:
        lb = router_loss.load_balance_terms(probs, valid, obj.fractions[layer], obj.tokens, obj.layers)
        term = term + obj.aux_coef * lb
        if key not in f.seen:
            _add("aux", lb)
    if obj.z_coef:
        z = router_loss.z_loss_terms(logits, valid, obj.tokens, obj.layers)
        term = term + obj.z_coef * z
        if key not in f.seen:
            _add("z", z)
    f.seen.add(key)
    return _Attach.apply(weights, term * obj.scale)


def _count(f: Feed, layer: int, own: torch.Tensor, routes: torch.Tensor | None, recorded: torch.Tensor | None) -> None:
    """This layer's statistics, kept on the device: nothing here reads a value on the host
    (a boolean index, ``int()`` or ``if tensor`` would wait for the device, per layer and
    micro-batch). A forward without real tokens adds load 0 over 0 layers."""
    valid = f.valid.to(own.device)
    used = own if not (f.replay and routes is not None) else torch.where(recorded[:, None], routes, own)
    experts = (
        _experts[layer] if layer in _experts else int(used.max()) + 1 if used.numel() else 1
    )  # unpatched routers only
    weight = valid[:, None].expand_as(used).flatten().to(torch.float32)
    load = torch.zeros(experts, device=own.device).index_add_(0, used.flatten(), weight)
    _add("load_ratio", load.max() / load.mean().clamp(min=1e-12))
    _add("load_layers", valid.any().to(torch.float64))
    if routes is None:
        return
    same = (own.sort(dim=1).values == routes.sort(dim=1).values).all(dim=1) & recorded
    _add("agree", same.sum())
    _add("decisions", recorded.sum())
    if f.differ is None:
        f.differ = torch.zeros_like(recorded)
        _add("recorded_tokens", recorded.sum())
    f.differ |= recorded & ~same


def _add(name: str, value: torch.Tensor) -> None:
    v = value.detach().double()
    _sums[name] = _sums[name] + v if name in _sums else v


def take_sums() -> dict[str, float]:
    """The statistics' sums since the last call (``agree``, ``decisions``, ``differ_tokens``,
    ``recorded_tokens``, ``load_ratio``, ``load_layers``, and the router objectives' values
    ``aux`` and ``z``), then reset."""
    names = ("agree", "decisions", "differ_tokens", "recorded_tokens", "load_ratio", "load_layers", "aux", "z")
    out = {k: float(_sums[k]) if k in _sums else 0.0 for k in names}
    _sums.clear()
    return out


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """The logged ratios (module docstring) of summed ``take_sums`` values; the route ones only
    when routes were recorded."""
    out = {"expert_load_max_mean": sums["load_ratio"] / max(sums["load_layers"], 1.0)} if sums["load_layers"] else {}
    if sums["decisions"]:
        out |= {
            "router_agreement": sums["agree"] / sums["decisions"],
            "routes_differ_tokens": sums["differ_tokens"] / max(sums["recorded_tokens"], 1.0),
        }
    return out


def patch_hf(model: torch.nn.Module) -> int:
    """Route every HF Qwen3-MoE router of ``model`` through ``choose``; returns how many."""
    done = 0
    for layer, block in enumerate(model.model.layers):
        router = getattr(block.mlp, "gate", None)
        if router is None or not hasattr(router, "top_k"):
            continue
        _experts[layer] = router.num_experts
        router.forward = _hf_forward(router, layer)
        done += 1
    return done


def _hf_forward(router: torch.nn.Module, layer: int):
    """Qwen3MoeTopKRouter.forward (transformers 5) with ``choose`` between the top-k and the gather."""

    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden_states, router.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, own = torch.topk(probs, router.top_k, dim=-1)
        idx = choose(layer, own)
        if idx is not own:
            top = probs.gather(1, idx)
        if router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, attach(layer, logits, probs, top.to(logits.dtype)), idx

    return forward


def patch_mcore(model: torch.nn.Module) -> int:
    """Route every mcore ``TopKRouter`` of ``model`` through ``choose`` (its ``RouterReplay``
    hook, built with ``moe_enable_routing_replay``); returns how many."""
    from megatron.core.transformer.moe.router import TopKRouter

    done = 0
    for m in model.modules():
        if isinstance(m, TopKRouter):
            if m.router_replay is None:
                raise RuntimeError("mcore router built without moe_enable_routing_replay: routes cannot be replayed")
            layer = int(m.layer_number) - 1
            _experts[layer] = m.config.num_moe_experts
            m.router_replay.get_replay_topk = _mcore_topk(layer, m.config.moe_router_pre_softmax)
            done += 1
    return done


def _mcore_topk(layer: int, pre_softmax: bool):
    """mcore hands the router's logits (its softmax under ``moe_router_pre_softmax``, when the
    z-loss has no logits: refused by ``recipe.backend_rules``)."""

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        idx = choose(layer, own)
        values = values if idx is own else scores.gather(1, idx)
        probs = scores if pre_softmax else torch.softmax(scores, dim=-1, dtype=torch.float32)
        return attach(layer, scores, probs, values), idx

    return get_replay_topk
