"""The megatron checkpoint streams through host memory (``engines.megatron.checkpoint``): the
save holds one parameter's assembled float32 master and moments at a time outside the host
copies, and the load's targets are empty host tensors built without the optimizer or a
collective. Checked on CPU with the assembly and the layout replaced by recording stand-ins;
that a real checkpoint round-trips across layouts is ``test_megatron_torchrun.py``'s."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from spmd_rl.engines.megatron import checkpoint

SHAPES = {"a.weight": (6, 4), "b.weight": (4, 4), "c.bias": (4,)}


class Engine(SimpleNamespace):
    def named_model_params(self):
        return iter(self.params.items())


def _engine() -> Engine:
    params = {name: torch.full(shape, float(k + 1)) for k, (name, shape) in enumerate(SHAPES.items())}
    return Engine(params=params, optimizer=SimpleNamespace(), mixed=True, shape=None, tp=1, step_count=7)


@pytest.fixture
def stand_ins(monkeypatch):
    """``tp_local_states`` hands out fresh tensors and remembers them weakly; ``_pieces`` files a
    tensor under its own name, as a TP-1 layout of a name HF shares would."""
    made: list[tuple[str, weakref.ref]] = []
    live_at_each_call: list[list[str]] = []

    def tp_local_states(opt, p, mixed, dp_group):
        live_at_each_call.append([name for name, ref in made if ref() is not None])
        out = {key: p.detach().float() * (1 + i) for i, key in enumerate(("param", *checkpoint.MOMENTS))}
        made.extend((key, weakref.ref(t)) for key, t in out.items())
        return out

    monkeypatch.setattr(checkpoint, "tp_local_states", tp_local_states)
    monkeypatch.setattr(checkpoint, "_dp_group", lambda p: None)
    monkeypatch.setattr(checkpoint, "_optimizer_of", lambda optimizers, p: None)
    monkeypatch.setattr(checkpoint, "_pieces", lambda name, t, s, tp, mesh: iter([(name, t)]))
    return live_at_each_call


def test_the_save_holds_one_parameters_assembled_states_at_a_time(stand_ins):
    engine = _engine()
    sd = checkpoint.state_dict(engine, mesh=None)
    # before each parameter's assembly, every tensor the previous ones assembled is freed: only
    # their host copies are kept (the old save filed the assembled tensors themselves)
    assert stand_ins == [[]] * len(SHAPES)
    for k, (name, p) in enumerate(engine.params.items()):
        assert torch.equal(sd["model"][name], p)
        assert torch.equal(sd["optim"]["state"][name]["exp_avg"], 2 * p)
        assert torch.equal(sd["optim"]["state"][name]["exp_avg_sq"], 3 * p)
        assert sd["model"][name].device.type == "cpu"
    assert int(sd["optim"]["step"]) == sd["steps"] == 7


def test_the_load_targets_are_empty_host_tensors_in_the_saves_layout(stand_ins, monkeypatch):
    engine = _engine()
    saved = checkpoint.state_dict(engine, mesh=None)

    def no_assembly(*args):
        raise AssertionError("the load's targets assembled the optimizer's states")

    monkeypatch.setattr(checkpoint, "tp_local_states", no_assembly)
    empty = checkpoint.empty_state_dict(engine, mesh=None)
    assert empty["model"].keys() == saved["model"].keys()
    assert empty["optim"]["state"].keys() == saved["optim"]["state"].keys()
    for name, t in empty["model"].items():
        assert (t.shape, t.dtype, t.device.type) == (saved["model"][name].shape, torch.float32, "cpu")
        for key in checkpoint.MOMENTS:
            assert empty["optim"]["state"][name][key].shape == t.shape


def test_a_host_copy_is_a_copy_even_on_cpu():
    t = torch.arange(4.0)
    h = checkpoint.to_host(t)
    assert torch.equal(h, t) and h.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
