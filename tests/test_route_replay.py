"""Routing replay's logic without vLLM (engines.route_replay, the routes column, the carry, the
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
from spmd_rl.config.stages import stages_for
from spmd_rl.engines import route_replay
from spmd_rl.engines.logprobs import build_batch
from spmd_rl.engines.rollout import Sample
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
    assert s["load_ratio"] == pytest.approx(3 / 1.5) and s["load_layers"] == 1
    with route_replay.feeding(routes, torch.tensor([True, True, True]), replay=False):
        assert torch.equal(route_replay.choose(0, own), own)
    assert route_replay.metrics(route_replay.take_sums()) == pytest.approx(
        {"router_agreement": 0.5, "routes_differ_tokens": 0.5, "expert_load_max_mean": 2 / 1.5})
    assert torch.equal(route_replay.choose(0, own), own)  # nothing current: the router's own choice


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
    assert piece.routes.tolist() == first.tolist() + second[4 * row:].tolist()
    assert piece.routes.numel() == (3 + 5 - 1) * row
    assert torch.equal(piece.columns()["prefix_routes"], piece.routes)


def test_the_graph_carries_routes_only_where_read(in_repo):
    moe = REPO / "configs/quickstart_moe.yaml"
    none = {s.name: s for s in stages_for(load_config(moe, ["actor.ppo_epochs=2"]))}
    assert not any("rollout_routes" in s.inputs + s.outputs for s in none.values())
    rec = {s.name: s for s in stages_for(load_config(moe, ["actor.ppo_epochs=2", "actor.router_replay=record"]))}
    assert "rollout_routes" in rec["actor_rollout"].outputs and "rollout_routes" in rec["actor_update"].inputs
    assert "rollout_routes" not in rec["actor_logprob"].inputs  # recorded for the metrics, not replayed
    rep = {s.name: s for s in stages_for(load_config(moe, ["actor.ppo_epochs=2", "actor.router_replay=rollout", "stream.partial_tokens=4"]))}
    assert "rollout_routes" in rep["actor_logprob"].inputs and "prefix_routes" in rep["actor_rollout"].inputs


@pytest.mark.parametrize("overrides,problem", [
    (("model.path=assets/tiny-qwen2",), "the model has no experts"),
    (("parallel.placement=separated", "parallel.gen_ranks=1"), "separated placement runs vLLM in its own process"),
])
def test_router_replay_is_refused_where_it_cannot_run(in_repo, tiny_model, tiny_moe, overrides, problem):
    res = CliRunner().invoke(app, ["validate", "configs/quickstart_moe.yaml", "actor.router_replay=rollout", *overrides])
    assert res.exit_code == 2 and "actor.router_replay" in res.output and problem in res.output, res.output


def test_engine_options_record_routes_per_device_kind():
    from spmd_rl.config.schema import RolloutConfig
    from spmd_rl.engines.vllm_options import engine_options

    cfg = RolloutConfig(n=1, max_response_length=4)
    cpu, cuda = engine_options("cpu", cfg, True, record_routes=True), engine_options("cuda", cfg, True, record_routes=True)
    assert not cpu["enable_prefix_caching"] and "enable_return_routed_experts" not in cpu  # the V1 runner's hooks
    assert not cuda["enable_prefix_caching"] and cuda["enable_return_routed_experts"]  # vLLM's own (Model Runner V2)
    assert engine_options("cuda", cfg, True)["enable_prefix_caching"] and "enable_return_routed_experts" not in engine_options("cuda", cfg, True)


def test_device_routes_are_checked_against_the_sequence():
    """On a device the routes are vLLM's ``routed_experts``; a table that does not cover
    context + response - 1 positions is refused, never trained misaligned."""
    import numpy as np

    from spmd_rl.distributed.accelerator import Accelerator
    from spmd_rl.engines.rollout import RolloutEngine

    engine = RolloutEngine.__new__(RolloutEngine)
    engine.acc = Accelerator("cuda", 0)
    done = type("C", (), {"index": 0, "token_ids": [5, 6, 7], "routed_experts": np.ones((4 + 3 - 1, 2, 2), np.uint8)})()
    (got,) = engine._routes([1, 2, 3, 4], [done], "0-x", 1)
    assert got.dtype == torch.uint8 and got.numel() == 6 * 2 * 2
    short = type("C", (), {"index": 0, "token_ids": [5, 6, 7], "routed_experts": np.ones((5, 2, 2), np.uint8)})()
    with pytest.raises(RuntimeError, match="vLLM routed 5 positions of request 0-x, expected 6"):
        engine._routes([1, 2, 3, 4], [short], "0-x", 1)
