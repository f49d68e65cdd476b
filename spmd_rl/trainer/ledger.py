"""Exactly-once prompt accounting in etcd: which prompts each committed iteration sampled,
the generators put, the update trained, still carries (partial rollout) and dropped (with the
reason).

Observed, not constructed: ``sampled`` is what the (trainer's) sampler handed out; ``put`` is
what the putters wrote into the dock, gathered from them (``stages.samples.put_prompts``, the
generators' report under separated placement); ``trained`` is what ``actor_update`` read from
the dock, each sample's ``prompt_row`` column gathered from the writers (``trainer.observed``).

Rank 0 writes one record per committed iteration under ``/<metadata.job>.ledger/step/<it>``
(outside the job's per-run prefix, which a restart clears). A run that resumes from the
checkpoint of iteration s first deletes the records of iterations >= s: the restored weights,
sampler and carried rows are those of the end of iteration s - 1, so those iterations are
redone, and the ledger always describes the lineage of the newest state. A fresh run clears it.

Invariant (``problems``; tested under SIGKILLs at random points): over the recorded
iterations, every prompt the sampler handed out is trained exactly once, or is still carried,
or is recorded as dropped with its reason, and never two of these. Per iteration:
carried before + sampled = trained + carried after + dropped, as disjoint sets; every
sampled row was put, and every row put was sampled or carried, once; every trained row was put
this iteration, and the update read exactly ``group_size`` samples of each; the policy
versions that generated the iterations (separated placement) never decrease. Prompts are
dataset rows, so a run checked this way stays within one epoch of the sampler.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from spmd_rl.dock.metadata import MetadataStore


@dataclass
class StepRecord:
    iteration: int
    sampled: list[int]
    trained: list[int]
    carried: list[int] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    """Row (as a string, JSON's key type) -> why it was not trained."""
    version: int | None = None
    """Separated placement: the policy version that generated the iteration's samples."""
    put: list[int] | None = None
    """The row of every prompt group the putters wrote this iteration (all rounds)."""
    trained_samples: int | None = None
    """How many samples the update read (repeats counted)."""
    group_size: int | None = None
    """Samples per prompt group (``rollout.n``)."""


class PromptLedger:
    def __init__(self, meta: MetadataStore):
        self.meta = meta

    def _key(self, iteration: int) -> str:
        return self.meta.key("step", f"{iteration:08d}")

    def restart_at(self, iteration: int) -> None:
        """Forget the records of iterations >= ``iteration`` and of policy versions >=
        ``iteration`` (they are about to be redone)."""
        for key, raw in self.meta.get_prefix(self.meta.key("step") + "/"):
            if json.loads(raw)["iteration"] >= iteration:
                self.meta.delete(key)
        for key, _ in self.meta.get_prefix(self.meta.key("weights") + "/"):
            if int(key.rsplit("/", 2)[-2]) >= iteration:
                self.meta.delete(key)

    def record(self, rec: StepRecord) -> None:
        self.meta.put(self._key(rec.iteration), json.dumps(asdict(rec), separators=(",", ":")).encode())

    def record_if_absent(self, rec: StepRecord) -> bool:
        """Write ``rec`` unless its iteration has a record (put-if-absent); whether it wrote."""
        return self.meta.create(self._key(rec.iteration), json.dumps(asdict(rec), separators=(",", ":")).encode())

    def of_replica(self, name: str, own: str) -> "PromptLedger":
        """The ledger of replica ``name`` of this job (this one's is replica ``own``'s)."""
        suffix = f".{own}.ledger"
        if not self.meta.job.endswith(suffix):
            raise ValueError(f"ledger {self.meta.job!r} is not replica {own}'s")
        job = self.meta.job[: -len(suffix)] + f".{name}.ledger"
        return PromptLedger(MetadataStore(self.meta.endpoints, job, self.meta.retry_s, tls=self.meta.tls))

    def record_weights(self, version: int, who: str, digest: str) -> None:
        """Separated placement: the digest of policy ``version`` as ``who`` ("sent" by the
        training leader, "received-<rank>" by a generator) saw it (``reshard.broadcast``)."""
        self.meta.put(self.meta.key("weights", f"{version:08d}", who), digest.encode())

    def weights(self) -> dict[int, dict[str, str]]:
        """Version -> {who: digest} of every recorded broadcast."""
        out: dict[int, dict[str, str]] = {}
        for key, raw in self.meta.get_prefix(self.meta.key("weights") + "/"):
            version, who = key.rsplit("/", 2)[-2:]
            out.setdefault(int(version), {})[who] = raw.decode()
        return out

    def read(self) -> list[StepRecord]:
        return [StepRecord(**json.loads(raw)) for _, raw in self.meta.get_prefix(self.meta.key("step") + "/")]


def problems(records: list[StepRecord], start_carried: list[int] | None = None) -> list[str]:
    """Every violation of the invariant in the module docstring (empty: exactly once)."""
    out: list[str] = []
    records = sorted(records, key=lambda r: r.iteration)
    its = [r.iteration for r in records]
    if its and its != list(range(its[0], its[0] + len(its))):
        out.append(f"iterations not contiguous: {its}")
    carried, trained, dropped = set(start_carried or []), set(), set()
    last_version: int | None = None
    for r in records:
        before = carried | set(r.sampled)
        after = set(r.trained) | set(r.carried) | {int(k) for k in r.dropped}
        if len(r.sampled) != len(set(r.sampled)) or set(r.sampled) & (carried | trained | dropped):
            out.append(f"iteration {r.iteration}: sampled a prompt already handed out")
        if len(r.trained) != len(set(r.trained)) or set(r.trained) & trained:
            out.append(f"iteration {r.iteration}: trained a prompt twice ({sorted(set(r.trained) & trained)[:8]})")
        if before != after or len(r.trained) + len(r.carried) + len(r.dropped) != len(after):
            out.append(
                f"iteration {r.iteration}: lost {sorted(before - after)[:8]}, appeared {sorted(after - before)[:8]}"
            )
        out += _observed(r, carried)
        if r.version is not None and last_version is not None and r.version < last_version:
            out.append(
                f"iteration {r.iteration}: policy version {r.version} after {last_version} (versions must not decrease)"
            )
        last_version = r.version if r.version is not None else last_version
        trained |= set(r.trained)
        dropped |= {int(k) for k in r.dropped}
        carried = set(r.carried)
    return out


def _observed(r: StepRecord, carried: set[int]) -> list[str]:
    """The checks of what the putters wrote and the update read against what was sampled."""
    out: list[str] = []
    if r.put is not None:
        if len(r.put) != len(set(r.put)):
            out.append(f"iteration {r.iteration}: a prompt was put twice")
        if set(r.sampled) - set(r.put):
            out.append(f"iteration {r.iteration}: sampled but never put {sorted(set(r.sampled) - set(r.put))[:8]}")
        if set(r.put) - set(r.sampled) - carried:
            out.append(
                f"iteration {r.iteration}: put {sorted(set(r.put) - set(r.sampled) - carried)[:8]}, neither sampled "
                f"nor carried"
            )
        if set(r.trained) - set(r.put):
            out.append(
                f"iteration {r.iteration}: trained {sorted(set(r.trained) - set(r.put))[:8]}, never put this iteration"
            )
    if (
        r.trained_samples is not None
        and r.group_size is not None
        and r.trained_samples != r.group_size * len(r.trained)
    ):
        out.append(
            f"iteration {r.iteration}: the update read {r.trained_samples} samples for {len(r.trained)} groups of "
            f"{r.group_size}"
        )
    return out
