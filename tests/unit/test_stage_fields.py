"""The stages read their config fields: the real ``actor_update``, ``advantage`` and ``reward``
stages through the real runner (``trainer.runner.run_stage``), with a fake dock, a fake engine
and a no-op residency around them (a world-1 gloo group for their
collectives), against formulas written out independently here in float64.

Each field is set to a value that changes the result on this data, so a stage that ignored it
would fail the comparison.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.loader import load_config
from spmd_rl.data.prompts import PromptSet
from spmd_rl.distributed.sides import Sides
from spmd_rl.recipe.graph import Modes, stages_for
from spmd_rl.trainer.context import Progress
from spmd_rl.dock.batch import DockBatch
from spmd_rl.trainer.metrics import StageTimer
from spmd_rl.trainer.runner import run_stage
from spmd_rl.trainer.stages.samples import encode_text
from tests.conftest import REPO

D = torch.float64
B, R = 6, 5


pytestmark = pytest.mark.usefixtures("world_of_one")


class FakeDock:
    def __init__(self, columns: dict[str, list[torch.Tensor]]):
        self.columns = columns
        self.puts: dict[str, object] = {}

    def get(self, stage, it, cols, layout, group_size=1, expected=None, parts=1):
        idx = torch.arange(len(next(iter(self.columns.values()))))
        return DockBatch(idx, {c: self.columns[c] for c in cols}, frozenset())

    def put(self, stage, it, data, indices):
        self.puts.update(data)


PROMPTS = [torch.tensor([7, 8 + k], dtype=torch.int32) for k in range(B)]  # sample k is recognisable in any order
ROWS = [torch.tensor(k, dtype=torch.int32) for k in range(B)]


def rows_of(micro) -> torch.Tensor:
    """The original sample index of each row of a micro-batch (the update stages reorder rows
    by length; a fake engine must follow the samples, not the positions)."""
    return micro.input_ids[:, 1] - 8


class FakeEngine:
    """Calls the stage's loss function on leaf log-prob / entropy tensors and keeps the grads of
    the first optimizer step (the configs run two PPO epochs so that old log-probs are read)."""

    def __init__(self, lp: torch.Tensor, ent: torch.Tensor):
        self.lp = lp.clone().requires_grad_(True)
        self.ent = ent.clone().requires_grad_(True)
        self.first: tuple | None = None

    def train_step(self, micro_batches, loss_fn, with_entropy=False, router=None):
        self.lp.grad = self.ent.grad = None
        self._step(micro_batches, loss_fn)
        if self.first is None:
            self.first = (self.lp.grad, self.ent.grad)
        return {"loss": 0.0, "grad_norm": 0.0, "lr": 0.0}

    def _step(self, micro_batches, loss_fn):
        for k, micro in enumerate(micro_batches):
            rows = rows_of(micro)
            loss_fn(self.lp[rows], self.ent[rows], k).backward()


def _cfg(*overrides: str):
    return load_config(
        REPO / "configs/quickstart.yaml",
        [
            "data.global_batch_size=2",
            "rollout.n=3",
            "actor.mini_batch_size=2",
            "actor.micro_batch_size=2",
            "actor.ppo_epochs=2",
            *overrides,
        ],
    )


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 4, 1, 5, 2]
    old = -torch.rand(B, R, generator=g, dtype=D) * 2
    lp = old + (torch.rand(B, R, generator=g, dtype=D) - 0.4) * 1.2  # ratios from 0.6 to 2.0
    roll = old + (torch.rand(B, R, generator=g, dtype=D) - 0.5) * 0.6
    ref = old + (torch.rand(B, R, generator=g, dtype=D) - 0.5)
    ent = torch.rand(B, R, generator=g, dtype=D) * 2
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5], dtype=D)
    mask = torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]
    return lengths, lp * mask, old * mask, roll * mask, ref * mask, ent * mask, adv, mask


def _run(cfg, dock, engine, **roles):
    tok = SimpleNamespace(pad_token_id=0)
    lay = SimpleNamespace(train=Layout(1, 1), gen=Layout(1, 1))
    residency = SimpleNamespace(enter=lambda phase, roles: None, weights_changed=lambda: None)
    return SimpleNamespace(
        cfg=cfg,
        lay=lay,
        peer=SimpleNamespace(rank=0, world=1),
        sides=Sides("both"),
        dock=dock,
        modes=Modes.of(cfg),
        roles={"actor": engine, **roles},
        rollout=None,
        tokenizer=tok,
        prompts=None,
        reward_fn=None,
        turns=None,
        progress=Progress(),
        residency=residency,
        replicas=None,
    )


def run_named(run, name: str):
    """Stage ``name`` of the run's config graph, through the real runner, on all B samples."""
    stage = next(s for s in stages_for(run.cfg) if s.name == name)
    return run_stage(run, 0, stage, list(range(B)), StageTimer())


def _stage_grads(cfg):
    lengths, lp, old, roll, ref, ent, adv, mask = _data()
    ragged = lambda t: [t[k, :n].float() for k, n in enumerate(lengths)]  # noqa: E731
    dock = FakeDock(
        {
            "prompt_ids": PROMPTS,
            "prompt_row": ROWS,
            "response_ids": [torch.arange(1, n + 1, dtype=torch.int32) for n in lengths],
            "seq_advantage": [torch.tensor(float(a)) for a in adv],
            "rollout_log_prob": ragged(roll),
            "old_log_prob": ragged(old),
            "ref_log_prob": ragged(ref),
        }
    )
    engine = FakeEngine(lp.float(), ent.float())
    run_named(_run(cfg, dock, engine), "actor_update")
    g_lp, g_ent = engine.first
    return g_lp.double(), (g_ent if g_ent is not None else torch.zeros_like(engine.ent)).double()


def _reference_grads(cfg):
    """The objective of the config, written out directly (token-mean, one mini-batch)."""
    _, lp, old, roll, ref, ent, adv, mask = _data()
    a, algo = cfg.actor, cfg.algorithm
    lp = lp.float().double().clone().requires_grad_(True)
    ent = ent.float().double().clone().requires_grad_(True)
    old, roll, ref = old.float().double(), roll.float().double(), ref.float().double()
    m = mask.to(D)
    A = adv[:, None].expand(B, R)
    r = torch.exp(lp - old)
    loss_t = torch.maximum(-A * r, -A * r.clamp(1 - a.loss.clip_ratio_low, 1 + a.loss.clip_ratio_high))
    if a.loss.clip_ratio_c is not None:
        loss_t = torch.where(A < 0, torch.minimum(loss_t, -A * a.loss.clip_ratio_c), loss_t)
    if a.correction.tis_cap is not None:
        loss_t = loss_t * torch.exp(old - roll).clamp(max=a.correction.tis_cap)
    log_r = ref - lp
    kl = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - 1 - log_r}[algo.kl_estimator]
    T = m.sum()
    total = (loss_t * m).sum() / T + algo.kl_coef * (kl * m).sum() / T - a.loss.entropy_coef * (ent * m).sum() / T
    total.backward()
    return lp.grad, ent.grad if ent.grad is not None else torch.zeros_like(ent)


BASE = ("algorithm.kl_coef=0.1", "actor.loss.clip_ratio_c=null")
FIELDS = [
    ("actor.loss.clip_ratio_low=0.05",),
    ("actor.loss.clip_ratio_high=0.05",),
    ("actor.loss.clip_ratio_c=1.5",),
    ("actor.loss.entropy_coef=0.3",),
    ("algorithm.kl_estimator=k1",),
    ("algorithm.kl_estimator=k2",),
    ("actor.correction.tis_cap=1.05",),
    ("algorithm.kl_coef=0.7",),
]


@pytest.mark.parametrize("override", FIELDS, ids=[f[0] for f in FIELDS])
def test_update_reads_its_fields(override):
    base = _cfg(*BASE)
    cfg = _cfg(*BASE, *override)
    g_lp, g_ent = _stage_grads(cfg)
    want_lp, want_ent = _reference_grads(cfg)
    # float32 stage (grads ~ A r / T ~ 0.1, eps 6e-8 x few ops) vs float64 formula (and the next line); measured 7.8e-9
    assert torch.allclose(g_lp, want_lp, atol=1e-6), (g_lp - want_lp).abs().max()
    assert torch.allclose(g_ent, want_ent, atol=1e-6)
    base_lp, base_ent = _reference_grads(base)
    # each field moves the float64 reference far beyond the 1e-6 round-off bound above (measured >= 2e-3)
    assert not (torch.allclose(want_lp, base_lp, atol=1e-6) and torch.allclose(want_ent, base_ent, atol=1e-6)), (
        "field has no effect here"
    )


class CountingEngine(FakeEngine):
    """Also records (samples, tokens) of every micro-batch of the first optimizer step."""

    def _step(self, micro_batches, loss_fn):
        if self.first is None:
            self.seen = [(len(m), int(m.attention_mask.sum())) for m in micro_batches]
        super()._step(micro_batches, loss_fn)


@pytest.mark.parametrize(
    "packed,want", [("true", [(1, 7), (2, 13), (3, 12)]), ("false", [(1, 7), (1, 7), (2, 11), (2, 7)])]
)
def test_token_budget_splits_by_tokens_and_keeps_the_objective(packed, want):
    """Samples of 7, 7, 6, 5, 4, 3 tokens (longest first) under a 13-token budget: packed, a
    micro-batch holds up to 13 real tokens; padded, count x longest <= 13. Either way the
    gradient is the one objective over the whole mini-batch."""
    cfg = _cfg(
        *BASE,
        "actor.loss.entropy_coef=0.3",
        "actor.micro_batch_size=6",
        "actor.micro_batch_tokens=13",
        f"actor.pack_sequences={packed}",
        "data.max_prompt_length=2",
        "rollout.max_response_length=5",
    )
    lengths, lp, old, roll, ref, ent, adv, mask = _data()
    ragged = lambda t: [t[k, :n].float() for k, n in enumerate(lengths)]  # noqa: E731
    dock = FakeDock(
        {
            "prompt_ids": PROMPTS,
            "prompt_row": ROWS,
            "response_ids": [torch.arange(1, n + 1, dtype=torch.int32) for n in lengths],
            "seq_advantage": [torch.tensor(float(a)) for a in adv],
            "rollout_log_prob": ragged(roll),
            "old_log_prob": ragged(old),
            "ref_log_prob": ragged(ref),
        }
    )
    engine = CountingEngine(lp.float(), ent.float())
    final = run_named(_run(cfg, dock, engine), "actor_update").final
    assert engine.seen == want
    assert final["micro_batches"] == len(want)
    want_lp, want_ent = _reference_grads(cfg)
    # float32 stage vs float64 formula (and the next line), as test_update_reads_its_fields; measured 7.8e-9
    assert torch.allclose(engine.first[0].double(), want_lp, atol=1e-6)
    assert torch.allclose(engine.first[1].double(), want_ent, atol=1e-6)


class InferEngine:
    """A forward-only role whose output row is the sample's index at every position."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    def infer(self, micro_batches, with_entropy=False):
        self.seen = [(len(m), int(m.attention_mask.sum())) for m in micro_batches]
        rows = torch.cat([rows_of(m) for m in micro_batches]).float()
        return rows[:, None].expand(-1, micro_batches[0].mask.shape[1]).clone(), None


def test_forward_stage_splits_by_tokens_and_returns_each_sample_its_own_row():
    cfg = _cfg(
        *BASE,
        "actor.micro_batch_size=6",
        "actor.micro_batch_tokens=13",
        "data.max_prompt_length=2",
        "rollout.max_response_length=5",
    )
    lengths = _data()[0]
    dock = FakeDock(
        {"prompt_ids": PROMPTS, "response_ids": [torch.arange(1, n + 1, dtype=torch.int32) for n in lengths]}
    )
    ref = InferEngine()
    run_named(_run(cfg, dock, None, ref=ref), "ref_logprob")
    assert ref.seen == [(1, 7), (2, 13), (3, 12)]  # the update's micro-batches (test above)
    got = dock.puts["ref_log_prob"]
    assert [t.numel() for t in got] == lengths
    assert [set(t.tolist()) for t in got] == [{float(k)} for k in range(B)]


def test_kl_in_reward_leaves_the_loss_without_kl():
    # use_kl_loss=false: the KL goes into the rewards (test_ppo_stages), the update reads no
    # reference log-probs and its objective has no KL term
    cfg = _cfg(*BASE)
    g_on, _ = _stage_grads(cfg)
    cfg_off = _cfg(*BASE, "algorithm.use_kl_loss=false")
    assert "ref_log_prob" not in next(s for s in stages_for(cfg_off) if s.name == "actor_update").inputs
    g_off, _ = _stage_grads(cfg_off)
    want, _ = _reference_grads(_cfg("actor.loss.clip_ratio_c=null", "algorithm.kl_coef=0"))
    # float32 stage vs float64 formula (measured 8e-9); the KL term moves the gradient by 5.3e-3 >> 1e-6
    assert torch.allclose(g_off, want, atol=1e-6) and not torch.allclose(g_on, g_off, atol=1e-6)


@pytest.mark.parametrize("by_std", [True, False])
def test_advantage_reads_norm_adv_by_std(by_std):
    rewards = [1.0, 0.0, 0.0, 2.0, 2.0, 5.0]
    dock = FakeDock(
        {"reward": [torch.tensor(x) for x in rewards], "response_length": [torch.tensor(2, dtype=torch.int32)] * B}
    )
    run_named(_run(_cfg(f"algorithm.norm_adv_by_std={str(by_std).lower()}"), dock, None), "advantage")
    got = dock.puts["seq_advantage"].tolist()  # one scalar per sample
    for g in (rewards[:3], rewards[3:]):
        mean = sum(g) / 3
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / 2)
        want = [(x - mean) / (std + 1e-6) if by_std else x - mean for x in g]
        got_g, got = got[:3], got[3:]
        # float32 stage output (eps 6e-8) of O(1) advantages vs the float64 formula; measured rel 4e-8
        assert got_g == pytest.approx(want, rel=1e-5)


def test_reward_reads_overlong_buffer_and_penalty():
    lengths = [2, 6, 7, 8, 8, 3]
    cfg = _cfg("algorithm.name=dapo", "algorithm.overlong_buffer=4", "algorithm.overlong_penalty=0.5")
    dock = FakeDock(
        {
            "response_ids": [torch.arange(n, dtype=torch.int32) for n in lengths],
            "response_length": [torch.tensor(n, dtype=torch.int32) for n in lengths],
            "answer": [encode_text("42" if k < 3 else "7") for k in range(B)],
            "prompt_row": [torch.tensor(0)] * B,
        }
    )
    run = _run(cfg, dock, None)
    run.prompts = PromptSet([[1]], ["42"], [0], ["q"])
    run.tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: ["42"] * len(ids))
    run.reward_fn = lambda text, answer, row: float(text == answer)
    run_named(run, "reward")
    sl = cfg.rollout.max_response_length  # 8: penalty -0.5 * (L - 4) / 4 beyond L = 4
    want = [(1.0 if k < 3 else 0.0) - 0.5 * min(max(n - (sl - 4), 0) / 4, 1.0) for k, n in enumerate(lengths)]
    # exact: 1 or 0 minus 0.5 x k/4, all dyadic, held exactly in float32; approx's default rel 1e-6
    assert dock.puts["reward"].tolist() == pytest.approx(want)


class InferSizes:
    """An engine whose ``infer`` records the size of every micro-batch it is handed."""

    def __init__(self):
        self.sizes: list[int] = []

    def infer(self, micro_batches):
        self.sizes += [len(m) for m in micro_batches]
        total = sum(len(m) for m in micro_batches)
        return torch.zeros(total, max(m.mask.shape[1] for m in micro_batches)), None


@pytest.mark.parametrize("ref_micro,actor_micro,want", [(None, 3, [3, 3]), (2, 3, [2, 2, 2]), (6, 2, [6])])
def test_ref_forward_splits_by_ref_micro_batch_size(ref_micro, actor_micro, want):
    """The reference forward (the real ``ref_logprob`` stage, through the runner) runs its 6
    samples in micro-batches of ``ref.micro_batch_size``, and of the actor's when unset; the
    actor's own forward keeps the actor's size."""
    cfg = _cfg(
        "algorithm.kl_coef=0.01",
        f"actor.micro_batch_size={actor_micro}",
        "actor.mini_batch_size=2",
        *([f"ref.micro_batch_size={ref_micro}"] if ref_micro else []),
    )
    dock = FakeDock(
        {"prompt_ids": PROMPTS, "response_ids": [torch.arange(1, n + 1, dtype=torch.int32) for n in [5, 3, 4, 1, 5, 2]]}
    )
    ref, actor = InferSizes(), InferSizes()
    run_named(_run(cfg, dock, actor, ref=ref), "ref_logprob")
    assert ref.sizes == want and actor.sizes == []


def test_a_stage_sees_only_its_declared_roles_and_no_dock(in_repo):
    """``StageView.of``: the engines of the roles a stage's graph entry declares and no other (a
    stage cannot reach the critic or the rollout engine it did not declare), the rollout engine
    only for a stage declaring it, and none of the dock, the sampler or the residency manager;
    with LoRA the reference (the actor with adapters off) comes with the actor."""
    from spmd_rl.trainer.stages.registry import StageCall, StageView

    cfg = _cfg("algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.use_kl_loss=true")
    engines = {r: SimpleNamespace(name=r) for r in ("actor", "ref", "critic")}
    run = _run(cfg, FakeDock({}), engines["actor"], ref=engines["ref"], critic=engines["critic"])
    run.rollout = "the rollout engine"
    graph = {s.name: s for s in stages_for(cfg)}
    assert set(StageView.of(run, graph["actor_update"]).roles) == {"actor"}
    assert set(StageView.of(run, graph["critic_update"]).roles) == {"critic"}
    assert StageView.of(run, graph["ref_logprob"]).roles == {"ref": engines["ref"]}
    assert StageView.of(run, graph["actor_rollout"]).rollout == "the rollout engine"
    assert StageView.of(run, graph["actor_update"]).rollout is None
    assert not {"dock", "sampler", "ledger", "residency", "peer"} & set(StageView.__dataclass_fields__)
    lora = _cfg("actor.lora.rank=4", "algorithm.kl_coef=0.01", "algorithm.use_kl_loss=true")
    ref = next(s for s in stages_for(lora) if s.name == "ref_logprob")
    assert ref.roles == ("actor",) and set(StageView.of(_run(lora, FakeDock({}), "a", ref="r"), ref).roles) == {
        "actor",
        "ref",
    }
    with pytest.raises(AttributeError, match="StageCall.run was removed in 0.2: read call.view"):
        StageCall(StageView(cfg=cfg), 0, graph["advantage"], None, True, []).run
