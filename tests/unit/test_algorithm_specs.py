"""Algorithms are specs (``algos.specs``): the stage graph, the rules and the advantage stage
read an algorithm's spec, and a user's spec from their own module (tests/helpers/algorithms.py)
is checked, graphed and computed like a built-in one, with no edit to the package; its
end-to-end run is ``test_algorithms_torchrun.py``'s."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from spmd_rl.algos.specs import ALGORITHMS, AlgorithmSpec, spec_named
from spmd_rl.config.loader import load_config
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.graph import advantage_column, stages_for
from tests.conftest import REPO

USER = "tests.helpers.algorithms:MEDIAN"


def _cfg(*overrides: str):
    return load_config(REPO / "configs/quickstart.yaml", list(overrides))


def test_every_built_in_is_registered_under_its_own_name():
    assert sorted(ALGORITHMS) == ["dapo", "dpo", "grpo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
    assert all(spec.name == name for name, spec in ALGORITHMS.items())
    assert [n for n, s in ALGORITHMS.items() if s.critic] == ["ppo"]
    assert {n for n, s in ALGORITHMS.items() if s.group_relative} == {
        "grpo",
        "dapo",
        "rloo",
        "reinforce_pp_baseline",
        "dpo",
    }


def test_a_users_spec_is_graphed_and_checked_like_a_built_in(in_repo):
    cfg = _cfg(f"algorithm.name={USER}")
    graph = stages_for(cfg)
    adv = next(s for s in graph if s.name == "advantage")
    assert adv.outputs == ("seq_advantage",) and adv.group_granular and advantage_column(cfg) == "seq_advantage"
    assert [s.name for s in graph] == [s.name for s in stages_for(_cfg("algorithm.name=rloo"))]
    # a group-relative algorithm: whole groups per training DP rank, N >= 2 (the rules read the spec)
    fields = {v.field for v in check(_cfg(f"algorithm.name={USER}", "rollout.n=1"))[1]}
    assert "rollout.n" in fields
    fields = {
        v.field for v in check(_cfg(f"algorithm.name={USER}", "data.global_batch_size=3", "actor.mini_batch_size=3"))[1]
    }
    assert "data.global_batch_size" in fields


@pytest.mark.parametrize(
    "name, problem",
    [
        ("tests.helpers.algorithms:median_baseline", "is not an AlgorithmSpec"),
        ("tests.helpers.no_such_module:SPEC", "not importable"),
        ("reinforce", "unknown algorithm 'reinforce'; registered: dapo, dpo, grpo"),
    ],
)
def test_a_bad_algorithm_name_is_refused_naming_the_problem(name, problem):
    with pytest.raises(ValueError, match=problem):
        spec_named(name)


def test_a_spec_must_be_named_by_its_path(monkeypatch):
    import tests.helpers.algorithms as module

    monkeypatch.setattr(module, "OTHER", AlgorithmSpec("other", "sequence", "grpo"), raising=False)
    with pytest.raises(ValueError, match="name it by its path"):
        spec_named("tests.helpers.algorithms:OTHER")


def test_the_advantage_stage_runs_the_users_estimator(world_of_one):
    """Through the stage, on one rank: A_i = r_i - median of its group, computed here by hand."""
    from types import SimpleNamespace

    from spmd_rl.trainer.stages.advantage import advantage

    rewards = [1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 0.0, 1.0]
    batch = type("Batch", (), {"columns": {"reward": [torch.tensor(r) for r in rewards]}, "__len__": lambda self: 8})()
    algorithm = SimpleNamespace(name=USER, norm_adv_by_std=True, kl_coef=0.0)
    run = SimpleNamespace(cfg=SimpleNamespace(algorithm=algorithm, rollout=SimpleNamespace(n=4)))
    out = advantage(SimpleNamespace(view=run, batch=batch, stage=SimpleNamespace(inputs=("reward",))))
    want = [1.0 - 0.25, 0.0 - 0.25, 0.5 - 0.25, 0.0, 1.0, 1.0, -1.0, 0.0]  # lower middles: 0.25 and 1.0
    assert out.columns["seq_advantage"].tolist() == want


def test_the_advantage_stage_runs_the_users_token_estimator(world_of_one):
    """``tests.helpers.algorithms:TOTAL`` through the stage on one rank, with KL in the reward:
    token rewards r_t = -beta kl_t + [t = L - 1] s, A_t = sum_t r_t on each sampled token, then
    (A - mean) / sqrt(unbiased var + 1e-8) over every sampled token of the batch, computed here
    in float64 from the formula (the built-in discounted returns give other values)."""
    from types import SimpleNamespace

    from spmd_rl.trainer.stages.advantage import advantage

    lengths, scores, beta = [3, 1, 2, 4], [1.0, 0.0, 2.0, 0.5], 0.1
    old = [torch.linspace(-1.0, -0.2, n) for n in lengths]
    ref = [o - 0.05 * (k + 1) for k, o in enumerate(old)]
    cols = {
        "reward": [torch.tensor(r) for r in scores],
        "response_length": [torch.tensor(n) for n in lengths],
        "old_log_prob": old,
        "ref_log_prob": ref,
    }
    batch = type("Batch", (), {"columns": cols, "__len__": lambda self: 4})()
    algorithm = SimpleNamespace(
        name="tests.helpers.algorithms:TOTAL", kl_coef=beta, kl_estimator="k1", gamma=0.5, norm_adv_by_std=True
    )
    cfg = SimpleNamespace(algorithm=algorithm, rollout=SimpleNamespace(n=2))
    run = SimpleNamespace(cfg=cfg, lay=SimpleNamespace(train=SimpleNamespace(group=1)), group=None, replicas=None)
    out = advantage(SimpleNamespace(view=run, batch=batch))
    total = [s - beta * float((o.double() - r.double()).sum()) for s, o, r in zip(scores, old, ref)]
    flat = [t for t, n in zip(total, lengths) for _ in range(n)]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1) + 1e-8)
    for got, t, n in zip(out.columns["advantages"], total, lengths):
        # float32 log-probs in, whitened in float64 (core.whiten) vs the float64 formula; measured rel 3e-9
        assert got.tolist() == pytest.approx([(t - mean) / std] * n, rel=1e-5)


def test_a_spec_whose_estimator_cannot_be_found_is_refused(monkeypatch):
    import tests.helpers.algorithms as module

    spec = AlgorithmSpec("tests.helpers.algorithms:LOST", "token", "tests.helpers.no_such:fn")
    monkeypatch.setattr(module, "LOST", spec, raising=False)
    with pytest.raises(ValueError, match="estimator 'tests.helpers.no_such:fn' cannot be found"):
        spec_named("tests.helpers.algorithms:LOST")


def test_every_declared_policy_loss_is_a_function_of_algos_policy_loss():
    """One table (``algos.specs.POLICY_LOSSES``): the config check reads its names, the ranks
    import what each names."""
    from spmd_rl.algos import policy_loss
    from spmd_rl.algos.specs import POLICY_LOSSES

    assert sorted(POLICY_LOSSES) == ["cispo", "gspo", "vanilla"]
    for name in POLICY_LOSSES:
        fn = POLICY_LOSSES.lookup(name)
        assert callable(fn) and fn.__module__ == policy_loss.__name__, name


@pytest.mark.parametrize(
    "name, problem",
    [
        ("foo", "unknown policy loss 'foo'"),
        ("tests.helpers.no_such:loss", "not found"),
        ("tests.helpers.algorithms:1x", "not a name"),
    ],
)
def test_a_bad_policy_loss_is_refused_by_validate(in_repo, name, problem):
    with pytest.raises(Exception, match=problem):
        _cfg(f"actor.loss.policy_loss={name}")


def test_a_users_policy_loss_has_the_on_policy_gradient_of_the_clipped_surrogate():
    """tests/helpers/algorithms.py's plain_pg (-A log pi): on policy (old = new log-probs) its
    gradient is the clipped surrogate's (-A d ratio = -A d log pi at ratio 1), its value is not."""
    from spmd_rl.algos.policy_loss import ClipConfig, get_policy_loss

    torch.manual_seed(0)
    logp = (-torch.rand(3, 5, dtype=torch.float64)).requires_grad_()
    adv, mask = torch.randn(3, dtype=torch.float64), torch.ones(3, 5)
    mask[1, 3:] = 0
    clip = ClipConfig(0.2, 0.2, None, "token-mean")
    user = get_policy_loss("tests.helpers.algorithms:plain_pg")(logp, logp.detach(), adv, mask, clip)
    vanilla = get_policy_loss("vanilla")(logp, logp.detach(), adv, mask, clip)
    (g_user,) = torch.autograd.grad(user.loss, logp)
    (g_vanilla,) = torch.autograd.grad(vanilla.loss, logp)
    # float64: both gradients are -A m / T (exp(0) = 1 exactly), a few ulp apart; measured bit-equal
    assert torch.allclose(g_user, g_vanilla, atol=1e-12)
    want = -(adv[:, None] * logp.detach() * mask).sum() / mask.sum()
    # float64, the same sum (allclose default); the two objectives' values differ by O(1)
    assert torch.allclose(user.loss.detach(), want) and not torch.allclose(user.loss, vanilla.loss)


SHORTER = "tests.helpers.algorithms:SHORTER"


def test_a_users_advantage_stage_is_the_graphs_and_the_runner_calls_it(in_repo, monkeypatch):
    """SHORTER's graph: the advantage stage reads what the spec declares and is computed by the
    user's function, which the runner looks up by the stage's ``fn`` (not by its name)."""
    from types import SimpleNamespace

    from spmd_rl.trainer import runner

    cfg = _cfg(f"algorithm.name={SHORTER}")
    adv = next(s for s in stages_for(cfg) if s.name == "advantage")
    assert (adv.inputs, adv.outputs, adv.group_granular) == (("reward", "response_length"), ("seq_advantage",), True)
    assert adv.fn == "tests.helpers.algorithms:shorter_is_better" and check(cfg)[1] == []
    monkeypatch.setattr(runner, "is_writer", lambda run, stage: True)
    monkeypatch.setattr(runner, "publish", lambda run, it, stage, indices, result, writer: result)

    class Batch(SimpleNamespace):
        def __len__(self):
            return len(self.indices)

    batch = Batch(
        indices=[0, 1, 2, 3],
        columns={
            "reward": [torch.tensor(x) for x in (1.0, 0.0, 1.0, 1.0)],
            "response_length": [torch.tensor(x) for x in (4.0, 2.0, 3.0, 5.0)],
        },
    )
    from spmd_rl.distributed.sides import Sides
    from spmd_rl.trainer.context import Progress

    run = SimpleNamespace(  # what the runner's StageView.of reads of a run
        cfg=cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"n": 2})}),
        **dict.fromkeys(("modes", "lay", "rollout", "tokenizer", "prompts", "reward_fn", "turns", "replicas")),
        sides=Sides("both"),
        roles={},
        progress=Progress(),
        residency=SimpleNamespace(weights_changed=lambda: None),
    )
    got = runner.compute(run, 0, adv, batch, [0, 1, 2, 3]).columns["seq_advantage"].tolist()
    # groups (1, 0 | lengths 4, 2) and (1, 1 | lengths 3, 5): r - mean(r) - 0.05 L
    # float32 output, r - mean - 0.05 L rounded once or twice (6e-8) vs approx's default rel 1e-6; measured 4e-8
    assert got == pytest.approx([0.5 - 0.2, -0.5 - 0.1, -0.15, -0.25])


def test_a_users_advantage_stage_is_refused_where_it_cannot_run(in_repo, monkeypatch):
    import tests.helpers.algorithms as module

    # KL in the reward: the user's stage is not handed the KL terms
    fields = {
        v.field
        for v in check(_cfg(f"algorithm.name={SHORTER}", "algorithm.kl_coef=0.01", "algorithm.use_kl_loss=false"))[1]
    }
    assert "algorithm.kl_coef" in fields
    # a column no stage before it writes
    bad = replace(module.SHORTER, name="tests.helpers.algorithms:NEEDS_VALUES", advantage_inputs=("reward", "values"))
    monkeypatch.setattr(module, "NEEDS_VALUES", bad, raising=False)
    spec_named.cache_clear()
    problems = check(_cfg("algorithm.name=tests.helpers.algorithms:NEEDS_VALUES"))[1]
    assert [v.field for v in problems] == ["algorithm.name"] and "reads values" in str(problems[0])
    # a stage of a token or critic spec, or one that cannot be found
    for kind, fn in (("token", module.SHORTER.advantage_stage), ("sequence", "tests.helpers.nope:f")):
        odd = replace(module.SHORTER, name="tests.helpers.algorithms:ODD", advantage=kind, advantage_stage=fn)
        monkeypatch.setattr(module, "ODD", odd, raising=False)
        spec_named.cache_clear()
        with pytest.raises(ValueError, match="advantage_stage"):
            spec_named("tests.helpers.algorithms:ODD")
    spec_named.cache_clear()
