"""``rewards.pool``: a rank's rewards run concurrently, each call under its own deadline; a call
that hangs, raises or returns no score scores ``reward.failure_score`` and is counted, and the
share is scored anyway (a hung verifier never stalls the rank)."""

from __future__ import annotations

import threading

import pytest

from spmd_rl.rewards.pool import RewardPool

NEVER = threading.Event()  # never set: a call waiting on it hangs for good


def _scores(fn, n=6, workers=3, timeout_s=0.5, batched=False):
    pool = RewardPool(fn, "my:rule", workers, timeout_s, failure_score=-1.0, batched=batched)
    return pool.score([str(k) for k in range(n)], [str(k) for k in range(n)], [{"data_source": ""}] * n)


def test_a_hung_call_times_out_and_the_rest_are_scored(caplog):
    def hangs_on_2(response, answer, row):
        if response == "2":
            NEVER.wait()
        return float(response == answer)

    with caplog.at_level("WARNING", logger="spmd_rl"):
        got = _scores(hangs_on_2)
    assert got.scores == [1.0, 1.0, -1.0, 1.0, 1.0, 1.0] and (got.timeouts, got.failures) == (1, 0)
    assert "0 call(s) failed and 1 ran past reward.timeout_s=0.5" in caplog.text


def test_as_many_hung_calls_as_workers_do_not_starve_the_others():
    """Every slot freed at the deadline: with 3 workers and 3 hung calls first, the other 3 are
    still scored (a fixed pool of 3 threads would time them all out)."""
    got = _scores(lambda r, a, w: NEVER.wait() if int(r) < 3 else 2.0)
    assert got.scores == [-1.0] * 3 + [2.0] * 3 and got.timeouts == 3


def test_errors_and_non_scores_are_failures_naming_the_first():
    def bad(response, answer, row):
        if response == "1":
            raise KeyError("extra_info")
        return "oops" if response == "4" else {"score": 0.5, "len": 2}

    got = _scores(bad)
    assert got.scores == [0.5, -1.0, 0.5, 0.5, -1.0, 0.5] and (got.failures, got.timeouts) == (2, 0)
    assert got.first_error == "KeyError: 'extra_info'" and got.metrics[0] == {"len": 2.0} and got.metrics[1] == {}


def test_calls_run_concurrently_up_to_workers():
    """Four calls that each wait for all four to arrive pass only if four run at once."""
    barrier = threading.Barrier(4)
    got = _scores(lambda r, a, w: barrier.wait(timeout=10) * 0 + 1.0, n=4, workers=4, timeout_s=30)
    assert got.scores == [1.0] * 4 and got.failures == 0
    too_few = threading.Barrier(4)
    got = _scores(lambda r, a, w: too_few.wait(timeout=1) * 0 + 1.0, n=4, workers=3, timeout_s=30)
    assert got.failures == 4  # three wait for a fourth that cannot start: every wait breaks


@pytest.mark.parametrize("workers", [1, 4])
def test_a_batched_reward_gets_chunks_and_a_bad_chunk_fails_alone(workers):
    seen = []

    def batched(responses, answers, rows):
        seen.append(len(responses))
        if "5" in responses and workers > 1:
            return [1.0]  # too short for its chunk
        return [float(r == a) * 3 for r, a in zip(responses, answers)]

    got = _scores(batched, n=7, workers=workers, batched=True)
    assert sorted(seen, reverse=True) == ([7] if workers == 1 else [2, 2, 2, 1])
    want = [3.0] * 7 if workers == 1 else [3.0, 3.0, 3.0, 3.0, -1.0, -1.0, 3.0]
    assert got.scores == want and got.failures == (workers > 1)


def hangs_on_seven(response: str, answer: str, row: dict) -> float:
    """A user's rule that hangs on one response (module level: the config names it)."""
    if response == "7":
        NEVER.wait()
    return 1.0


def test_the_reward_stage_scores_through_the_pool_the_reward_section_describes(in_repo, tiny_model):
    """``reward.workers``, ``reward.timeout_s``, ``reward.failure_score`` and ``reward.batched``
    reach the stage: the hung sample scores the failure value and is counted in the metrics."""
    import torch

    from spmd_rl.config.loader import load_config
    from spmd_rl.data.prompts import PromptSet
    from spmd_rl.dock.batch import DockBatch
    from spmd_rl.rewards import get_reward
    from spmd_rl.rewards.pool import pool_of
    from spmd_rl.trainer.stages.registry import StageCall, StageView
    from spmd_rl.trainer.stages.reward import reward
    from spmd_rl.trainer.stages.samples import encode_text

    over = ["reward.rule=tests.unit.test_reward_pool:hangs_on_seven", "reward.workers=2", "reward.timeout_s=0.3"]
    cfg = load_config("configs/quickstart.yaml", [*over, "reward.failure_score=-0.5"])
    texts = ["1", "7", "3"]

    class Tok:
        def batch_decode(self, ids, skip_special_tokens):
            return [texts[int(i[0])] for i in ids]

    columns = {
        "response_ids": [torch.tensor([k]) for k in range(3)],
        "answer": [encode_text("1")] * 3,
        "response_length": [torch.tensor(1, dtype=torch.int32)] * 3,
        "prompt_row": [torch.tensor(0)] * 3,
    }
    view = StageView(
        cfg=cfg, tokenizer=Tok(), reward_fn=get_reward(cfg.reward.rule), prompts=PromptSet([[1]], ["1"], [0], ["q"])
    )
    got = reward(StageCall(view, 0, None, DockBatch(torch.arange(3), columns, frozenset()), True, [0, 1, 2]))
    assert got.columns["reward"].tolist() == [1.0, -0.5, 1.0]
    assert (got.sums["reward_timeouts"], got.sums["reward_failures"]) == (1.0, 0.0)
    batched = load_config("configs/quickstart.yaml", [*over, "reward.batched=true"])
    assert pool_of(batched.reward, len).batched and pool_of(cfg.reward, len).workers == 2


def test_math_verify_scores_on_the_pools_threads():
    """math-verify's own timeouts need the main thread (``signal.alarm``); on the pool's threads
    the rule runs without them, under the pool's deadline, and still judges."""
    from spmd_rl.rewards import get_reward

    pool = RewardPool(get_reward("math_verify", format_score=0.2), "math_verify", 2, 30.0, failure_score=-1.0)
    got = pool.score(["$\\frac{4}{2}$", "$3$", "no answer"], ["$2$"] * 3, [{}] * 3)
    assert got.scores == [1.0, 0.2, 0.0] and got.failures == 0


def test_the_failure_counts_reach_the_iterations_metrics_row():
    """The reward stage's counts are summed over the side into the row ``metrics.jsonl`` gets
    (a one-rank gloo group here): counted but never logged, no user would see them."""
    import torch.distributed as dist

    from spmd_rl.trainer.iteration_metrics import IterationMetrics
    from spmd_rl.trainer.stages.registry import StageResult

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = IterationMetrics(None)
        m.add(StageResult(sums={"generated": 4.0, "reward_timeouts": 2.0, "reward_failures": 1.0}))
        row = m.finish()
    finally:
        dist.destroy_process_group()
    assert (row["reward_timeouts"], row["reward_failures"]) == (2.0, 1.0)
