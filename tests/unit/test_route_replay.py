"""Routing replay's logic without vLLM (engines.training.route_replay, the routes column, the carry, the
rules and the graph): replayed rows take the recorded experts and only those, the statistics
count each (token, layer) once and compare expert sets, the patched HF router equals
transformers' own when nothing is replayed, and a carried response's routes keep the rows of
the segment that sampled each token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.config.loader import load_config
from spmd_rl.recipe.graph import stages_for
from spmd_rl.engines.training import route_replay
from spmd_rl.engines.training.logprobs import build_batch
from spmd_rl.engines.base import Sample
from spmd_rl.trainer.carry import Piece
from tests.conftest import REPO


def test_place_puts_each_sample_position_at_its_row_and_marks_the_rest():
    routes = [torch.tensor([[[1, 2]], [[3, 0]]], dtype=torch.uint8), torch.tensor([[[2, 3]]], dtype=torch.uint8)]
    out, valid = route_replay.place([3, 2], 8, lambda b, t: t * 2 + b, routes)  # sequence-first, as mcore
    assert out.shape == (8, 1, 2) and valid.tolist() == [True, True, True, True, True, False, False, False]
    assert out[0, 0].tolist() == [1, 2] and out[2, 0].tolist() == [3, 0] and out[1, 0].tolist() == [2, 3]
    assert (out[[3, 4, 5, 6, 7]] == -1).all()  # each sample's last token and the padding: not recorded


def test_choose_replays_recorded_rows_and_counts_each_layer_once(monkeypatch):
    monkeypatch.setitem(route_replay._experts, 0, 4)  # what patching a 4-expert router records
    route_replay.take_sums()
    own = torch.tensor([[0, 1], [2, 3], [1, 0]])
    routes = torch.tensor([[[1, 0]], [[2, 1]], [[-1, -1]]])  # token 0 same set in another order; token 1 differs
    with route_replay.feeding(routes, torch.tensor([True, True, True]), replay=True):
        got = route_replay.choose(0, own)
        again = route_replay.choose(0, own)  # a backward's recompute
    assert got.tolist() == [[1, 0], [2, 1], [1, 0]] and torch.equal(got, again)
    s = route_replay.take_sums()
    assert (s["agree"], s["decisions"], s["differ_tokens"], s["recorded_tokens"]) == (1, 2, 1, 2)
    # load of the experts used (replayed), over the real tokens: experts 0..3 get 2, 3, 1, 0 of 6
    # exact: a ratio of integer expert counts (max 3 over mean 1.5); approx's default
    assert s["load_ratio"] == pytest.approx(3 / 1.5) and s["load_layers"] == 1
    with route_replay.feeding(routes, torch.tensor([True, True, True]), replay=False):
        assert torch.equal(route_replay.choose(0, own), own)
    # ratios of small integer counts: at most one float32 rounding (6e-8) vs approx's default rel 1e-6
    assert route_replay.metrics(route_replay.take_sums()) == pytest.approx(
        {"router_agreement": 0.5, "routes_differ_tokens": 0.5, "expert_load_max_mean": 2 / 1.5}
    )
    assert torch.equal(route_replay.choose(0, own), own)  # nothing current: the router's own choice


def test_the_statistics_never_read_the_device(monkeypatch):
    """Counting reads no value on the host (one would wait for the device per layer and
    micro-batch): on the meta device, which holds no values, any such read raises. Padding
    tokens add no load: experts 0..3 get 2, 2, 0, 0 of the two real tokens' 4 choices (with the
    padding token's 2, 2, 1, 1)."""
    monkeypatch.setitem(route_replay._experts, 0, 4)
    monkeypatch.setitem(route_replay._experts, 1, 4)
    route_replay.take_sums()
    own = torch.tensor([[0, 1], [2, 3], [1, 0]])
    routes = torch.tensor([[[1, 0], [1, 0]], [[2, 1], [2, 1]], [[-1, -1], [-1, -1]]])
    with route_replay.feeding(routes, torch.tensor([True, False, True]), replay=False, device="meta"):
        for layer in (0, 1):
            assert route_replay.choose(layer, own.to("meta")).device.type == "meta"
    route_replay._sums.clear()
    with route_replay.feeding(routes[:, :1], torch.tensor([True, False, True]), replay=False):
        route_replay.choose(0, own)
    assert route_replay.take_sums()["load_ratio"] == pytest.approx(2 / 1)  # max 2 over mean 4/4


def test_the_patched_hf_router_is_transformers_own_without_replay(tiny_moe):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    router = model.model.layers[1].mlp.gate
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = [t.clone() for t in router(x)]
    assert route_replay.patch_hf(model) == model.config.num_hidden_layers
    got = router(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    forced = torch.tensor([[[3, 0]]] * 7).expand(7, 4, 2).contiguous()
    with route_replay.feeding(forced, torch.ones(7, dtype=torch.bool), replay=True):
        logits, weights, idx = router(x)
    probs = torch.softmax(logits, -1)[:, [3, 0]]
    # float32, the router's own softmax and renormalisation: a few ulp vs allclose's default rtol 1e-5
    assert idx.tolist() == [[3, 0]] * 7 and torch.allclose(weights, probs / probs.sum(-1, keepdim=True))
    route_replay.take_sums()


def test_build_batch_refuses_routes_of_the_wrong_size():
    good = torch.zeros((3 + 2 - 1) * 4 * 2, dtype=torch.uint8)
    batch = build_batch([torch.tensor([1, 2, 3])], [torch.tensor([4, 5])], 0, [good], (4, 2))
    assert batch.routes[0].shape == (4, 4, 2) and batch[0:1].routes[0].shape == (4, 4, 2)
    with pytest.raises(ValueError, match="sample 0: rollout_routes holds 24 ids, expected 4 positions"):
        build_batch([torch.tensor([1, 2, 3])], [torch.tensor([4, 5])], 0, [good[:24]], (4, 2))


def test_a_carried_response_keeps_each_segments_rows():
    """Prompt of 3, segments of 2 then 3 tokens: the first returns rows 0..3 (3 + 2 - 1), the
    second recomputes the whole context (rows 0..6) and adds only rows 4..6."""
    row = 2  # ids per position: layers x top_k
    first = torch.arange(4 * row, dtype=torch.uint8)
    second = torch.arange(100, 100 + 7 * row, dtype=torch.uint8)
    piece = Piece(0)
    piece.extend(Sample([7, 8], [-0.1, -0.2], routes=first), version=0, limit=10)
    piece.extend(Sample([9, 10, 11], [-0.3] * 3, routes=second), version=1, limit=10)
    assert piece.routes.tolist() == first.tolist() + second[4 * row :].tolist()
    assert piece.routes.numel() == (3 + 5 - 1) * row
    assert torch.equal(piece.columns()["prefix_routes"], piece.routes)


def test_the_graph_carries_routes_only_where_read(in_repo):
    moe = REPO / "configs/quickstart_moe.yaml"
    none = {s.name: s for s in stages_for(load_config(moe, ["actor.ppo_epochs=2"]))}
    assert not any("rollout_routes" in s.inputs + s.outputs for s in none.values())
    rec = {s.name: s for s in stages_for(load_config(moe, ["actor.ppo_epochs=2", "actor.moe.router_replay=record"]))}
    assert "rollout_routes" in rec["actor_rollout"].outputs and "rollout_routes" in rec["actor_update"].inputs
    assert "rollout_routes" not in rec["actor_logprob"].inputs  # recorded for the metrics, not replayed
    rep = {
        s.name: s
        for s in stages_for(
            load_config(moe, ["actor.ppo_epochs=2", "actor.moe.router_replay=rollout", "stream.partial_tokens=4"])
        )
    }
    assert "rollout_routes" in rep["actor_logprob"].inputs and "prefix_routes" in rep["actor_rollout"].inputs


@pytest.mark.parametrize(
    "overrides,field,problem",
    [
        (("model.path=assets/tiny-qwen2",), "actor.moe.router_replay", "the model has no experts"),
        (
            ("parallel.placement=separated", "parallel.gen_ranks=1"),
            "actor.moe.router_replay",
            "separated placement runs vLLM in its own process",
        ),
        (("actor.compile=true",), "actor.compile", "nothing would be replayed"),
        (
            ("actor.moe.router_replay=none", "actor.moe.aux_loss_coef=0.01"),
            "actor.moe.aux_loss_coef",
            "counted from the rollout's routes",
        ),
        (
            ("actor.moe.router_replay=none", "model.path=assets/tiny-qwen2", "actor.moe.z_loss_coef=0.01"),
            "actor.moe.z_loss_coef",
            "no router",
        ),
    ],
)
def test_router_replay_is_refused_where_it_cannot_run(in_repo, tiny_model, tiny_moe, overrides, field, problem):
    res = CliRunner().invoke(
        app, ["validate", "configs/quickstart_moe.yaml", "actor.moe.router_replay=rollout", *overrides]
    )
    assert res.exit_code == 2 and field in res.output and problem in res.output, res.output


def _vllms_aux_output_check(options: dict) -> None:
    """vLLM's own build-time check of routed-expert options (``VllmConfig``, 0.31 and later), run
    on ``options`` for a MoE model on Model Runner V2, one pipeline stage, no KV connector."""
    from types import SimpleNamespace as NS

    from vllm.config import VllmConfig

    VllmConfig._verify_aux_output_compatibility(
        NS(
            aux_output_config=NS(enabled=options.get("enable_return_routed_experts", False)),
            use_v2_model_runner=True,
            model_config=NS(runner_type="generate", is_moe=True),
            cache_config=NS(enable_prefix_caching=options["enable_prefix_caching"]),
            speculative_config=None,
            parallel_config=NS(
                pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1
            ),
            kv_transfer_config=None,
        )
    )


def test_engine_options_record_routes_per_device_kind_and_vllm_release():
    """CPU: the V1 runner's hooks, prefix caching off (a cached block is never routed). Device:
    vLLM's own routes; from 0.31 vLLM refuses them with prefix caching off (its AuxOutput
    connector keys routes by block hash), so ``compat`` keeps it on there and off before."""
    from spmd_rl.config.schema import RolloutConfig
    from spmd_rl.engines.vllm import compat
    from spmd_rl.engines.vllm.options import engine_options

    cfg = RolloutConfig(n=1, max_response_length=4)
    cpu = compat.adjust_engine_options("0.32.0+cpu", engine_options("cpu", cfg, True, record_routes=True))
    assert not cpu["enable_prefix_caching"] and "enable_return_routed_experts" not in cpu
    raw = engine_options("cuda", cfg, True, record_routes=True)
    with pytest.raises(ValueError, match="requires prefix caching"):
        _vllms_aux_output_check(raw)  # what the tested release did with these options before compat
    for version, cached in (("0.26.0", False), ("0.30.1", False), ("0.31.0", True), ("0.32.0", True), ("0.33.0", True)):
        cuda = compat.adjust_engine_options(version, raw)
        assert cuda["enable_return_routed_experts"] and cuda["enable_prefix_caching"] is cached, version
    _vllms_aux_output_check(compat.adjust_engine_options("0.32.0", raw))
    plain = compat.adjust_engine_options("0.26.0", engine_options("cuda", cfg, True))
    assert plain["enable_prefix_caching"] and "enable_return_routed_experts" not in plain


def test_device_routes_are_checked_against_the_sequence():
    """On a device the routes are vLLM's ``routed_experts``; a table that does not cover
    context + response - 1 positions is refused, never trained misaligned."""
    import numpy as np

    from spmd_rl.distributed.accelerator import Accelerator
    from spmd_rl.engines.vllm.engine import VllmRollout

    engine = VllmRollout.__new__(VllmRollout)
    engine.acc = Accelerator("cuda", 0)
    done = type("C", (), {"index": 0, "token_ids": [5, 6, 7], "routed_experts": np.ones((4 + 3 - 1, 2, 2), np.uint8)})()
    (got,) = engine._routes([1, 2, 3, 4], [done], "0-x", 1)
    assert got.dtype == torch.uint8 and got.numel() == 6 * 2 * 2
    short = type("C", (), {"index": 0, "token_ids": [5, 6, 7], "routed_experts": np.ones((5, 2, 2), np.uint8)})()
    with pytest.raises(RuntimeError, match="vLLM routed 5 positions of request 0-x, expected 6"):
        engine._routes([1, 2, 3, 4], [short], "0-x", 1)


def test_router_terms_are_the_formula_and_split_invariant():
    """algos.router_loss against Switch's and ST-MoE's formulas in float64 on the whole
    mini-batch: the per-micro-batch sums with global f and T add up to them."""
    from spmd_rl.algos import router_loss

    g = torch.Generator().manual_seed(0)
    layers, tokens, experts, k = 2, 12, 4, 2
    logits = torch.randn(layers, tokens, experts, generator=g, dtype=torch.float64)
    valid = torch.rand(tokens, generator=g) > 0.25
    routes = [torch.rand(5, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.uint8) for _ in range(3)]
    counts = router_loss.load_fractions(routes, experts)
    f = counts / counts.sum(1, keepdim=True)
    T = float(valid.sum())
    p = logits.softmax(-1)
    want_lb = sum(experts * (f[l] * p[l][valid].mean(0)).sum() for l in range(layers)) / layers
    want_z = sum(torch.logsumexp(logits[l][valid], -1).square().mean() for l in range(layers)) / layers
    for cut in ([12], [5, 7], [1, 4, 7]):
        lb = z = 0.0
        for part in torch.arange(tokens).split(cut):
            for l in range(layers):
                lb += float(router_loss.load_balance_terms(p[l][part], valid[part], f[l], T, layers))
                z += float(router_loss.z_loss_terms(logits[l][part], valid[part], T, layers))
        # router_loss sums in float32: E=4 matmuls and <= 12-token sums, eps 6e-8 x ~10; measured rel 1e-7 (0.1)
        assert lb == pytest.approx(float(want_lb), rel=1e-6) and z == pytest.approx(float(want_z), rel=1e-6)
    slots = torch.stack([r.long() for r in routes]).permute(2, 0, 1, 3).reshape(layers, -1)
    assert torch.equal(counts, torch.stack([torch.bincount(s, minlength=experts) for s in slots]).double())


def test_the_attached_router_terms_give_the_formulas_gradient(tiny_moe):
    """The patched HF router injects d(scale x (a L_lb + b L_z)) into the router's weight through
    its gate weights, whatever the loss downstream: equal to autograd of the formula computed
    directly from the router's logits."""
    from spmd_rl.algos import router_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    route_replay.patch_hf(model)
    router = model.model.layers[2].mlp.gate
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    valid = torch.tensor([True] * 7 + [False] * 2)
    f = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 4)
    obj = route_replay.RouterObjective(aux_coef=0.3, z_coef=0.05, fractions=f, tokens=20.0, layers=4, scale=2.0)
    with route_replay.objective(obj), route_replay.feeding(None, valid, replay=False):
        _, weights, _ = router(x)
        (weights * 0).sum().backward()
    assert route_replay._objective is None  # put back after the block
    got = router.weight.grad.clone()
    w = router.weight.detach().clone().requires_grad_(True)
    logits = x @ w.T
    want = 2.0 * (
        0.3 * router_loss.load_balance_terms(logits.softmax(-1), valid, f[2], 20.0, 4)
        + 0.05 * router_loss.z_loss_terms(logits, valid, 20.0, 4)
    )
    want.backward()
    # float32 both, the same formula's autograd; rtol 1e-5 covers another gemm blocking (eps 6e-8 x 128 terms)
    assert got.abs().max() > 0 and torch.allclose(got, w.grad, atol=1e-7, rtol=1e-5)
    sums = route_replay.take_sums()
    assert sums["aux"] > 0 and sums["z"] > 0
