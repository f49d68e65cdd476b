"""The training engine reads its ActorConfig fields: a real FSDP2 TrainEngine on the tiny model
in a world-1 gloo group, one optimizer step each, checked against AdamW's formulas."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from spmd_rl.config.schema import ActorConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.logprobs import build_batch
from spmd_rl.engines.train import TrainEngine
from spmd_rl.engines.base import local


pytestmark = pytest.mark.usefixtures("world_of_one")


def _engine(tiny_model, **fields) -> TrainEngine:
    cfg = ActorConfig(mini_batch_size=1, micro_batch_size=2, lr=1e-3, **fields)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    return TrainEngine(tiny_model, detect("cpu"), mesh, cfg, "float32", total_steps=10)


def _batch():
    return build_batch([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [torch.tensor([11, 12]), torch.tensor([13, 14, 15])], 0)


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: local(p).detach().clone().float() for n, p in engine.named_weights()}


def test_weight_decay_alone_shrinks_the_weights(tiny_model):
    """With a zero loss the AdamW step is the decay alone: p <- p (1 - lr wd)."""
    e = _engine(tiny_model, weight_decay=0.1)
    before = _params(e)
    e.train_step([_batch()], lambda lp, ent, k: lp.sum() * 0.0)
    after = _params(e)
    for n in before:
        assert torch.allclose(after[n], before[n] * (1 - 1e-3 * 0.1), rtol=1e-6, atol=1e-9), n


@pytest.mark.parametrize("clip", [1e-3, 1e3])
def test_betas_and_grad_clip_set_the_first_moment(tiny_model, clip):
    """exp_avg after one step = (1 - beta1) * g * min(1, clip / |g|)."""
    e = _engine(tiny_model, betas=(0.5, 0.9), grad_clip=clip)
    out = e.train_step([_batch()], lambda lp, ent, k: -lp.sum())
    moments = torch.cat([local(s["exp_avg"]).flatten() for s in e.optimizer.state.values()])
    norm = out["grad_norm"]
    want = 0.5 * norm * min(1.0, clip / (norm + 1e-6))
    assert float(moments.norm()) == pytest.approx(want, rel=1e-4)
    assert (norm > clip) == (clip == 1e-3)  # the small clip is active, the large one is not


def test_param_dtype_and_activation_checkpointing(tiny_model):
    e = _engine(tiny_model, param_dtype="bfloat16", activation_checkpointing=True)
    assert {local(p).dtype for p in e.model.parameters()} == {torch.bfloat16}
    assert e.model.is_gradient_checkpointing
    plain = _engine(tiny_model)
    assert {local(p).dtype for p in plain.model.parameters()} == {torch.float32} and not plain.model.is_gradient_checkpointing
    out = e.train_step([_batch()], lambda lp, ent, k: -lp.sum())  # recomputation runs
    assert out["grad_norm"] > 0


def test_bucketed_gather_in_the_generation_dtype_equals_gather_then_cast(tiny_model):
    """The resharder casts each shard before its gather: the same bits as the full master tensor
    cast afterwards, and every bucket within its bound (or one tensor when larger)."""
    from spmd_rl.config.schema import ReshardConfig
    from spmd_rl.reshard.allgather_swap import Resharder

    from types import SimpleNamespace

    engine = _engine(tiny_model)
    no_rollout = SimpleNamespace(weight_bytes=lambda: 0, kv_cache_bytes=lambda: 0)  # the gather only records the ledger
    rs = Resharder(engine, no_rollout, ReshardConfig(bucket_bytes=32 << 10), "bfloat16")
    got = dict(rs.full_weights())
    want = {n: p.full_tensor().to(torch.bfloat16) for n, p in engine.model.named_parameters()}
    assert got.keys() == want.keys()
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
    largest = max(t.numel() * 2 for t in want.values())
    assert rs.temp_peak <= max(32 << 10, largest)
