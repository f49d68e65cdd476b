"""One trajectory's bookkeeping without an engine (``envs.trajectory``): sampled and inserted
tokens, the exact-prefix rendering, and partial rollout's rebuild from the dock's tokens and
mask (``Trajectory.replay``), against the trajectory that produced them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from spmd_rl.envs.base import Step, Turn
from spmd_rl.envs.trajectory import Trajectory


class Counting:
    """Observation "seen N" after every turn, reward 0.5 each; done after ``turns`` turns."""

    def __init__(self, turns: int = 3, shift: int = 0):
        self.n, self.turns, self.shift = 0, turns, shift

    def step(self, turn):
        self.n += 1
        if self.n >= self.turns:
            return Step(done=True, reward=1.0)
        return Step(observation=f"seen {self.n + self.shift}: {turn.text[:4]}", reward=0.5, metadata={"tool_calls": 1})


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _new(tok, env) -> Trajectory:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "12+30="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return Trajectory(0, prompt, [{"role": "user", "content": "12+30="}], env)


def _play(tok, env, turns: list[str], pause_after: int | None = None) -> Trajectory:
    """Sample ``turns`` (each ends on <|im_end|>), the last one cut after ``pause_after`` tokens."""
    t = _new(tok, env)
    for k, text in enumerate(turns):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        last = k + 1 == len(turns)
        if last and pause_after is not None:
            t.add_sampled(ids[:pause_after], [-0.1] * pause_after, False, tok)
            return t
        out = t.add_sampled(ids, [-0.1] * len(ids), True, tok)
        assert t.apply(t.env.step(Turn(out, tuple(ids))), tok, 200, 8) or last
    return t


def test_inserted_tokens_are_the_template_rendering_past_the_trajectory(tok):
    t = _play(tok, Counting(), ["42", "forty-two"])
    text = tok.decode(t.prompt + t.ids)
    assert (
        "42<|im_end|>\n<|im_start|>tool\nseen 1: "
        "42<|im_end|>\n<|im_start|>assistant\nforty-two<|im_end|>\n<|im_start|>tool\nseen 2" in text
    )
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert t.stats["turns"] == 2 and t.stats["tool_calls"] == 2 and t.reward == 1.0
    assert sum(t.mask) == t.stats["sampled_tokens"] and len(t.mask) - sum(t.mask) == t.stats["inserted_tokens"]


@pytest.mark.parametrize("pause_after", [None, 2])
def test_replay_rebuilds_the_carried_trajectory(tok, pause_after):
    """Paused before a turn (after an inserted tool turn) or mid-turn: the rebuilt trajectory
    holds the same tokens, mask, conversation, reward and counts, and its environment is where
    the original's was (its next answer is the same)."""
    orig = _play(tok, Counting(turns=4), ["42", "forty-two", "4 2"], pause_after=pause_after)
    copy = _new(tok, Counting(turns=4))
    assert copy.replay(orig.ids, orig.logprobs, orig.mask, tok, 200, 8) is True
    for field in (
        "ids",
        "logprobs",
        "mask",
        "messages",
        "reward",
        "stats",
        "open_turn",
        "turn_start",
        "last_text",
        "done",
    ):
        assert getattr(copy, field) == getattr(orig, field), field
    assert copy.env.n == orig.env.n


def test_replay_of_an_environment_that_now_answers_differently_ends_with_the_dock_tokens(tok):
    orig = _play(tok, Counting(turns=4), ["42", "forty-two"])
    copy = _new(tok, Counting(turns=4, shift=1))  # "seen 2" where the dock holds "seen 1"
    assert copy.replay(orig.ids, orig.logprobs, orig.mask, tok, 200, 8) is False
    assert copy.done and copy.stats["prefix_breaks"] == 1
    assert (copy.ids, copy.logprobs, copy.mask) == (orig.ids, orig.logprobs, orig.mask)  # nothing altered is trained


class Raising(Counting):
    def step(self, turn):
        raise RuntimeError("the tool's server went away")


class Hanging(Counting):
    def step(self, turn):
        import time

        time.sleep(3)  # past the 0.5 s timeout; short, as the pool thread outlives the call


@pytest.mark.parametrize("env", [Raising(), Hanging()], ids=["raises", "hangs"])
def test_a_replay_whose_environment_raises_or_hangs_ends_as_a_prefix_break(tok, env):
    """In ``advance`` a raising or slow environment is the policy's observation; in a replay it
    crashed the rank (or hung it). Now it ends the trajectory as a prefix break, on the dock's
    tokens and with the carried reward."""
    import time

    orig = _play(tok, Counting(turns=4), ["42", "forty-two"])
    copy = _new(tok, env)
    t0 = time.monotonic()
    assert (
        copy.replay(orig.ids, orig.logprobs, orig.mask, tok, 200, 8, carried_reward=orig.reward, step_timeout_s=0.5)
        is False
    )
    assert time.monotonic() - t0 < 5
    assert copy.done and copy.stats["prefix_breaks"] == 1 and copy.reward == orig.reward == 1.0
    assert (copy.ids, copy.logprobs, copy.mask) == (orig.ids, orig.logprobs, orig.mask)


def test_a_broken_replay_keeps_the_carried_reward(tok):
    """The fresh environment's answer to the step whose observation is rejected must not count:
    the trajectory keeps what its first environment gave."""
    orig = _play(tok, Counting(turns=4), ["42", "forty-two"])
    copy = _new(tok, Counting(turns=4, shift=1))
    assert copy.replay(orig.ids, orig.logprobs, orig.mask, tok, 200, 8, carried_reward=orig.reward) is False
    assert copy.reward == orig.reward  # on the earlier code 0.5 (the rejected step's) and not the carried 1.0


def test_turn_seeds_do_not_collide_across_ranks_samples_or_turns():
    """Two ranks of one iteration: the call's seed carries each rank's first sample index (0 and
    64 here, 64 trajectories each, 4 turns). The affine seeds collided (rank 0's sample 16 took
    rank 1's sample 0's seeds); every (sample, turn) now has its own."""
    from spmd_rl.envs.multi_turn import request_seed

    seeds = [
        request_seed(base + first, first + k, t)
        for base in (1000,)
        for first in (0, 64)
        for k in range(64)
        for t in range(4)
    ]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**62 for s in seeds)
    affine = [base + first + k * 4 + t for base in (1000,) for first in (0, 64) for k in range(64) for t in range(4)]
    assert len(set(affine)) < len(affine)  # what the earlier form gave (with the rank's offset in its seed)
    assert request_seed(7, 3, 1) == request_seed(7, 3, 1)  # a rerun samples the same
