"""The critic-free estimators, CISPO and the rollout corrections through the whole trainer (real
torchrun with 2 ranks, etcd, vLLM), one iteration each:

- split invariance end to end: the same samples trained with 2 FSDP ranks and 16-sample
  micro-batches, or 2 TP ranks and 4-sample micro-batches with the reward and group advantage
  stages fused into generation, give the same objective and gradient (RLOO's and REINFORCE++'s
  advantages, REINFORCE++'s batch whitening over the DP ranks, CISPO's loss);
- the correction bands act: IcePop masks tokens, MIS rejects samples (a band so narrow that the
  float32 trainer/vLLM mismatch leaves it), and the gradient changes accordingly.

A user's algorithm, a spec and an estimator in the user's own module
(``tests/helpers/algorithms.py``), trains with no edit to the package; so does one whose graph
has the user's own advantage stage.

Learning on the quickstart task is ``test_learning_torchrun.py``'s rloo-cispo-hf and
reinforce_pp-lora modes."""

from __future__ import annotations

import pytest

from tests.dock_dump import columns, dump_env
from tests.trainer_util import N, train

ONE = ("trainer.iterations=1", "checkpoint.interval=0")
LAYOUTS = {
    "dp2-micro16": ("parallel.train.dp_shard=2", "parallel.train.tp=1", "actor.micro_batch_size=16"),
    # and the stages that can run while generation runs, fused with it (stream.fuse): fusion moves
    # work in time, never its result, for every estimator (a whole-batch advantage stays out)
    "tp2-micro4-fused": (
        "parallel.train.dp_shard=1",
        "parallel.train.tp=2",
        "actor.micro_batch_size=4",
        "stream.fuse=true",
        "stream.micro_batch_size=2",
    ),
}
ALGOS = {
    "rloo": ("algorithm.name=rloo",),
    "reinforce_pp": (
        "algorithm.name=reinforce_pp",
        "algorithm.kl_coef=0.05",
        "algorithm.use_kl_loss=false",
        "algorithm.gamma=0.99",
    ),
    "reinforce_pp_baseline": ("algorithm.name=reinforce_pp_baseline",),
    "cispo": ("actor.loss.policy_loss=cispo", "actor.ppo_epochs=2"),  # the second epoch is off-policy: weights clip
}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.fixture(scope="module")
def grpo(tiny_model, tmp_path_factory, etcd):
    """GRPO with the vanilla objective on the same samples: what each algorithm must differ from."""
    return train(tmp_path_factory.mktemp("grpo"), "grpo", etcd.endpoint, *ONE, *LAYOUTS["dp2-micro16"])[0]


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(ALGOS))
def test_the_objective_does_not_depend_on_the_split(tiny_model, tmp_path, etcd, grpo, algo):
    a, b = (
        train(tmp_path, f"{algo}-{name}", etcd.endpoint, *ONE, *ALGOS[algo], *lay)[0] for name, lay in LAYOUTS.items()
    )
    assert a["reward_mean"] == b["reward_mean"] == grpo["reward_mean"]  # the same samples
    assert abs(a["grad_norm"] - grpo["grad_norm"]) > 1e-4 * grpo["grad_norm"]  # and the algorithm acted
    # float32: DP2/micro 16 vs TP2/micro 4 sum the same gradient in other orders; rel ~1e-6 (and the next line, abs 1e-7
    # where the loss is ~0)
    assert _rel(a["grad_norm"], b["grad_norm"]) < 1e-5, (a["grad_norm"], b["grad_norm"])
    assert _rel(a["loss"], b["loss"]) < 1e-5 or abs(a["loss"] - b["loss"]) < 1e-7, (a["loss"], b["loss"])
    assert b["fused_waves_early"] + b["fused_waves_late"] > 0 and "fused_waves_early" not in a  # b was fused
    if (
        algo == "reinforce_pp"
    ):  # the KL-in-reward path ran (its value is 0 here: at iteration 0 the actor is the reference;
        assert a["kl_reward"] == b["kl_reward"] == 0.0  # its formula is test_estimators.py's)


@pytest.mark.slow
def test_icepop_and_mis_bands_mask_and_reject(tiny_model, tmp_path, etcd, grpo):
    """Against the GRPO run of the same samples and layout, without the bands."""
    base = grpo
    cut = train(
        tmp_path,
        "cut",
        etcd.endpoint,
        *ONE,
        *LAYOUTS["dp2-micro16"],
        "actor.correction.icepop_band=[0.9999999,1.0000001]",
        "actor.correction.mis_band=[0.99999999,1.00000001]",
    )[0]
    assert base["reward_mean"] == cut["reward_mean"]
    assert 0 < cut["icepop_masked_frac"] < 1 and 0 < cut["mis_rejected_frac"] <= 1, cut
    assert "icepop_masked_frac" not in base and "mis_rejected_frac" not in base
    assert abs(cut["grad_norm"] - base["grad_norm"]) > 1e-6 * base["grad_norm"]


@pytest.mark.slow
def test_a_users_algorithm_from_its_own_module_trains(tiny_model, tmp_path, etcd):
    """``algorithm.name: tests.helpers.algorithms:MEDIAN`` and ``actor.loss.policy_loss:
    tests.helpers.algorithms:plain_pg``: the run trains; every sample's ``seq_advantage`` in the
    dock is its reward minus its prompt group's median (the lower middle value), as the user's
    function defines it, recomputed here from the dock's rewards; and the logged loss is the
    user's -sum A log pi / tokens (token-mean), recomputed from the dock's rollout log-probs
    (vLLM's, within 1e-5 of the trainer's), not the clipped surrogate's -sum A / tokens."""
    dump = tmp_path / "dump"
    row = train(
        tmp_path,
        "median",
        etcd.endpoint,
        *ONE,
        *LAYOUTS["dp2-micro16"],
        "algorithm.name=tests.helpers.algorithms:MEDIAN",
        "actor.loss.policy_loss=tests.helpers.algorithms:plain_pg",
        extra_env=dump_env(dump),
    )[0]
    assert row["grad_norm"] > 0
    cols = columns(dump)[0]
    rewards, adv = cols["reward"], cols["seq_advantage"]
    assert sorted(adv) == sorted(rewards) and len(adv) == 8 * N
    for i in adv:
        group = sorted(float(rewards[j]) for j in range(i - i % N, i - i % N + N))
        # float32 dock column of r - median(r) (|A| <= ~1): eps 6e-8 x 1
        assert abs(float(adv[i]) - (float(rewards[i]) - group[(N - 1) // 2])) < 1e-6, (i, group, float(adv[i]))
    assert any(float(a) != 0 for a in adv.values())
    lengths = {i: int(cols["response_length"][i]) for i in adv}
    logp = {i: cols["rollout_log_prob"][i].double()[: lengths[i]].sum() for i in adv}
    tokens = sum(lengths.values())
    want = -sum(float(adv[i]) * float(logp[i]) for i in adv) / tokens
    surrogate = -sum(float(adv[i]) * lengths[i] for i in adv) / tokens
    assert abs(row["loss"] - want) < 1e-3 * abs(want) + 1e-4, (row["loss"], want, surrogate)
    assert abs(want - surrogate) > 10 * (1e-3 * abs(want) + 1e-4)  # the two objectives are told apart


@pytest.mark.slow
def test_a_users_advantage_stage_from_its_own_module_trains(tiny_model, tmp_path, etcd):
    """``algorithm.name: tests.helpers.algorithms:SHORTER``: the graph's advantage stage is the
    user's function, which reads the response lengths besides the rewards; every
    ``seq_advantage`` in the dock is its formula recomputed here from the dock's rewards and
    lengths (each token costs ``LENGTH_WEIGHT``), which the built-in group-mean estimator would
    not give."""
    from tests.helpers.algorithms import LENGTH_WEIGHT

    dump = tmp_path / "dump"
    row = train(
        tmp_path,
        "shorter",
        etcd.endpoint,
        *ONE,
        *LAYOUTS["dp2-micro16"],
        "algorithm.name=tests.helpers.algorithms:SHORTER",
        extra_env=dump_env(dump),
    )[0]
    assert row["grad_norm"] > 0
    cols = columns(dump)[0]
    rewards, lengths, adv = cols["reward"], cols["response_length"], cols["seq_advantage"]
    assert len(adv) == 8 * N
    for i in adv:
        group = range(i - i % N, i - i % N + N)
        r_mean = sum(float(rewards[j]) for j in group) / N
        want = float(rewards[i]) - r_mean - LENGTH_WEIGHT * float(lengths[i])
        # float32 dock column of r - mean(r) - w L: eps 6e-8 x |A| <= ~2
        assert abs(float(adv[i]) - want) < 1e-6, (i, float(adv[i]), want)
        assert abs(float(adv[i]) - (float(rewards[i]) - r_mean)) > 1e-3  # not the built-in group-mean advantage
