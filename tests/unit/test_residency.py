"""The residency manager, through the engine interface with recording fakes (the device-only
calls, vLLM sleep/wake and empty_cache, are recorded on CPU):

- entering a stage, exactly its roles plus the pinned ones are resident (from the ledger); a
  stage without roles (host-only work) moves nothing;
- stale rollout weights are gathered from the actor before the actor leaves, and the KV cache
  wakes last (the peak-bounding order); weights that did not change and were not dropped are
  not gathered again;
- the colocated engine sleeps at level 2 (its weights are dropped, not backed up to host), and
  a wake after it always gathers, even when the actor did not step;
- every swap is bit-exact.
"""

from __future__ import annotations

import torch

from spmd_rl.config.schema import ReshardConfig
from spmd_rl.reshard.allgather_swap import Resharder
from spmd_rl.reshard.residency import Residency
from tests.unit.test_reshard_order import FakeRollout, RecordingAccelerator, TinyEngine


class SleepingRollout(FakeRollout):
    asleep = False

    def sleep(self, discard_weights=False):
        super().sleep(discard_weights)
        self.asleep = True

    def wake_kv_cache(self):
        super().wake_kv_cache()
        self.asleep = False

    def resident(self):
        return not self.asleep

    def weight_bytes(self):
        return 100

    def kv_cache_bytes(self):
        return 1000


def _setup(pinned=frozenset()):
    calls: list = []
    RecordingAccelerator.calls = calls
    acc = RecordingAccelerator("cpu")
    torch.manual_seed(0)
    actor = TinyEngine(acc, torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    ref = TinyEngine(acc, torch.nn.Linear(4, 3))
    rollout = SleepingRollout(calls, list(actor.model.parameters()))
    res = Residency(
        Resharder(actor, rollout, ReshardConfig(bucket_bytes=64), "float32"), {"actor": actor, "ref": ref}, set(pinned)
    )
    return res, calls, actor, ref


def _snapshot(engine):
    return [p.detach().clone() for p in engine.model.parameters()]


def test_only_the_declared_roles_are_resident_and_swaps_are_bit_exact():
    res, calls, actor, ref = _setup()
    before = {"actor": _snapshot(actor), "ref": _snapshot(ref)}
    plan = [
        ("actor_rollout", ("rollout",)),
        ("reward", ()),
        ("ref_logprob", ("ref",)),
        ("actor_update", ("actor",)),
        ("actor_rollout", ("rollout",)),
    ]
    resident: set = set()
    for phase, roles in plan:
        res.enter(phase, roles)
        resident = set(roles) or resident  # a stage without roles keeps the previous residency
        assert res.ledger.resident_roles(phase) == resident, (phase, res.ledger.last(phase))
    assert res.ledger.resident_roles("reward") == {"rollout"}  # no sleep round trip for host-only work
    res.enter("checkpoint", ("actor", "ref"))
    after = {"actor": _snapshot(actor), "ref": _snapshot(ref)}
    assert all(torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]))


def test_stale_weights_are_gathered_before_the_actor_leaves_and_the_kv_cache_wakes_last():
    res, calls, *_ = _setup()
    res.enter("actor_rollout", ("rollout",))
    assert calls == [
        "empty_cache",
        "wake_weights",
        "update_weights:4",
        "empty_cache",
        "wake_kv_cache(train_resident=0)",
    ]
    calls.clear()
    res.enter("reward", ())
    res.enter("actor_rollout", ("rollout",))  # the actor did not step and nothing slept: no move at all
    assert calls == ["empty_cache"]
    calls.clear()
    res.enter("ref_logprob", ("ref",))
    assert calls[0] == "sleep(level 2)"  # colocated: the weights are dropped, not copied to host
    calls.clear()
    res.enter("actor_rollout", ("rollout",))  # the actor did not step, but the dropped weights are gathered again
    assert "update_weights:4" in calls and calls[-1] == "wake_kv_cache(train_resident=0)"
    calls.clear()
    res.enter("actor_update", ("actor",))
    res.weights_changed()
    res.enter("actor_rollout", ("rollout",))
    assert "update_weights:4" in calls and calls[-1] == "wake_kv_cache(train_resident=0)"


def test_pinned_roles_stay_resident():
    res, *_ = _setup(pinned={"ref"})
    for phase, roles in [("actor_rollout", ("rollout",)), ("advantage", ()), ("actor_update", ("actor",))]:
        res.enter(phase, roles)
        assert res.ledger.resident_roles(phase) == (set(roles) or {"rollout"}) | {"ref"}


def test_off_cpu_each_phase_records_what_the_allocator_holds_beside_the_drivers_count():
    """The swap check of tools/gpu_smoke.py compares ``mem_<phase>_allocated_bytes`` (this
    process's allocator) between runs, not the driver's total - free (issue 70, finding 2)."""
    import tools.gpu_smoke as smoke

    res, _, _, _ = _setup()
    counts = iter([(1000, 40), (1500, 90)])

    class Device(type(res.acc)):
        def device_used_bytes(self):
            return self.now[0]

        def allocated_bytes(self):
            return self.now[1]

    res.acc.__class__ = Device
    for phase in ("actor_rollout", "actor_update"):
        res.acc.now = next(counts)
        res.enter(phase, ("rollout",) if phase == "actor_rollout" else ("actor",))
    got = res.iteration_memory(["actor_rollout", "actor_update"])
    assert got["mem_actor_rollout_allocated_bytes"] == 40 and got["mem_actor_update_allocated_bytes"] == 90
    assert got["mem_actor_update_device_bytes"] == 1500
    assert smoke.memory(got, "actor_update") == 90  # the allocator's count, not the driver's
    del got["mem_actor_update_allocated_bytes"]
    assert smoke.memory(got, "actor_update") == got["mem_actor_update_bytes"]  # CPU: the ledger
