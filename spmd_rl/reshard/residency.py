"""The residency manager: the one owner of every memory move of a run.

Each stage of the graph declares the roles it needs (``recipe.graph.Stage.roles``). A stage that
needs none (rule rewards, advantages: host-only work) moves nothing. Entering any other stage,
the manager

1. releases what the stage does not need: the rollout engine sleeps, and every
   other role's local state goes to host (``HostSwap``, bit-exact) unless it is pinned
   (``ref.offload_to_host: false``, ``reward.offload_to_host: false``,
   ``critic.offload_to_host: false``, or ``reshard.mode: naive`` for the actor);
2. returns the freed blocks (``empty_cache``);
3. makes the stage's roles resident. The rollout engine is the allgather-swap: when its weights
   are older than the actor's, the actor's shards are gathered bucket by bucket into it first
   (the actor is brought back for the gather if it was on host, and leaves again before the KV
   cache wakes, so training state, weights and KV cache are never resident together). A
   colocated engine sleeps at vLLM level 2, dropping its weights instead of backing them up to
   host: every wake after it is followed by a gather, which overwrites them anyway. An engine
   serving LoRA adapters (``actor.lora.sync: adapter``) sleeps at level 1, keeping the base
   weights it loaded once, and gets the adapters again after every wake;
4. records a ledger row: every role's resident bytes at the stage's entry.

Invariant (tested from the ledger): while a stage runs, the resident roles are the stage's
roles plus the pinned ones, or the previous stage's for a stage without roles (plus the rollout
engine on CPU, where vLLM has no sleep mode).
"""

from __future__ import annotations

from spmd_rl.engines.base import Engine
from spmd_rl.reshard.allgather_swap import Resharder
from spmd_rl.reshard.ledger import Ledger
from spmd_rl.reshard.swap import HostSwap, resident_bytes

TRAINABLE = ("actor", "critic")


class Residency:
    def __init__(self, resharder: Resharder, engines: dict[str, Engine], pinned: set[str]):
        """``engines``: the training-side roles (actor, and ref / critic / reward_model when the
        config has them). All start resident, the rollout engine awake; its weights count as
        stale until the first gather (the actor may have been resumed from a checkpoint)."""
        self.resharder = resharder
        self.rollout = resharder.rollout
        self.acc = resharder.acc
        self.engines = engines
        self.pinned = set(pinned)
        self.swaps = {role: resharder.swap if role == "actor" else HostSwap(self.acc) for role in engines}
        self.on_host: set[str] = set()
        self.rollout_awake = self.rollout is not None and self.rollout.resident()
        self.colocated = resharder.train is not None and self.rollout is not None
        # separated placement: a generator's weights arrive by broadcast, never by a gather here
        self.actor_version, self.rollout_version = 0, -1 if resharder.train is not None else 0
        self.ledger = Ledger()
        self.device_bytes: dict[str, int] = {}
        self.allocated_bytes: dict[str, int] = {}

    # -- moves ----------------------------------------------------------------------------------
    def _tensors(self, role: str) -> list:
        e = self.engines[role]
        return e.param_tensors() + (e.grad_tensors() + e.optimizer_tensors() if role in TRAINABLE else [])

    def _offload(self, role: str) -> None:
        if role in self.on_host or role in self.pinned:
            return
        if role == "actor":
            self.resharder.offload_train()
        else:
            self.swaps[role].track(self._tensors(role))
            self.swaps[role].offload()
        self.on_host.add(role)

    def _reload(self, role: str) -> None:
        if role in self.on_host:
            self.swaps[role].reload()
            self.on_host.discard(role)

    def weights_changed(self) -> None:
        """The actor took an optimizer step: the rollout weights are stale."""
        self.actor_version += 1

    def enter(self, phase: str, roles: tuple[str, ...] | set[str]) -> None:
        """Make exactly ``roles`` (plus the pinned ones) resident for ``phase`` (module docstring)."""
        want = set(roles)
        if not want:  # host-only work: whatever is resident stays
            self.record(phase)
            return
        adapters = self.rollout is not None and self.rollout.serves_adapters  # LoRA adapter sync keeps the base
        stale = "rollout" in want and (
            self.rollout_version != self.actor_version
            or not self.rollout.weights_current
            or self.rollout.adapters_stale
        )
        if "rollout" not in want and self.rollout_awake:
            self.rollout.sleep(discard_weights=self.colocated and not adapters)
            self.rollout_awake = False
        for role in self.engines:
            if role not in want and not (stale and role == "actor"):
                self._offload(role)
        self.acc.empty_cache()
        if stale:
            self._reload("actor")
            self.resharder.load_rollout()
            self.rollout_version = self.actor_version
            self.rollout_awake = False  # the KV cache is still released
            if "actor" not in want:
                self._offload("actor")
            self.acc.empty_cache()
        elif "rollout" in want and not self.rollout_awake:
            self.rollout.wake_weights()
        if "rollout" in want and not self.rollout_awake:
            self.rollout.wake_kv_cache()
            self.rollout_awake = True
        for role in want & set(self.engines):
            self._reload(role)
        self.record(phase)

    # -- accounting -----------------------------------------------------------------------------
    def record(self, phase: str) -> None:
        row: dict[str, int] = {"temp": self.resharder.temp_peak if phase == "actor_rollout" else 0}
        for role, e in self.engines.items():
            row[f"{role}_params"] = resident_bytes(e.param_tensors())
            if role in TRAINABLE:
                row[f"{role}_grads"] = resident_bytes(e.grad_tensors())
                row[f"{role}_optim"] = resident_bytes(e.optimizer_tensors())
        if self.rollout is not None and self.rollout.resident():
            row["rollout_weights"], row["kv_cache"] = self.rollout.weight_bytes(), self.rollout.kv_cache_bytes()
        self.ledger.record(phase, **row)
        used, allocated = self.acc.device_used_bytes(), self.acc.allocated_bytes()
        if used is not None:
            self.device_bytes[phase] = used
        if allocated is not None:
            self.allocated_bytes[phase] = allocated

    def iteration_memory(self, phases: list[str]) -> dict[str, float]:
        """Metrics of this rank: the ledger total at each phase's entry (``mem_<phase>_bytes``),
        off CPU the device bytes in use then (``mem_<phase>_device_bytes``, from the driver: vLLM's
        memory included) and the bytes torch's allocator holds in tensors (``mem_<phase>_allocated_bytes``:
        the training state without vLLM's pool), and the reference's resident bytes at the last phase (0 when it
        went back to host)."""
        out = {}
        for p in phases:
            out[f"mem_{p}_bytes"] = float(self.ledger.total(p))
            if p in self.device_bytes:
                out[f"mem_{p}_device_bytes"] = float(self.device_bytes[p])
            if p in self.allocated_bytes:
                out[f"mem_{p}_allocated_bytes"] = float(self.allocated_bytes[p])
        if "ref" in self.engines:
            out["ref_resident_bytes"] = float(self.ledger.last(phases[-1])["ref_params"])
        return out
