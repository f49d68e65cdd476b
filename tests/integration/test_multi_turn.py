"""Multi-turn rollouts on a real in-process vLLM (``tests/helpers/multi_turn_probe.py``, one
engine for every test here): tokens in and out, the response mask, budgets, tool failures, the
exact-prefix invariant, and the trainer's view of a trajectory (an HF forward of the same
tokens, the gradient of the loss)."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.conftest import run_helper


@pytest.fixture(scope="module")
def server():
    """A loopback TCP server model-written code must not reach: counts its connections."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    accepted: list[int] = []

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield sock.getsockname()[1], accepted
    sock.close()


@pytest.fixture(scope="module")
def probe(tiny_model, server):
    return run_helper("multi_turn_probe.py", tiny_model, server[0], timeout=600)


def _runs(mask: list[int]) -> int:
    return sum(1 for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1]))


@pytest.mark.slow
def test_a_trajectory_is_sampled_turns_with_rendered_tool_turns_between_them(probe):
    for t in probe["echo"]:
        s = t["stats"]
        assert s["turns"] == 3 and s["tool_calls"] == 2 and _runs(t["mask"]) == 3, t
        assert sum(t["mask"]) == s["sampled_tokens"] and len(t["mask"]) - sum(t["mask"]) == s["inserted_tokens"] > 0, t
        assert t["reward"] == pytest.approx(1.25), t  # 0.5 + 0.5 + 0.25: the environment's contributions
    text = probe["echo_text"]
    assert text.count("<|im_start|>tool\nok 1<|im_end|>\n<|im_start|>assistant\n") == 1, text
    assert "<|im_start|>tool\nok 2<|im_end|>" in text, text
    # continuous batching and lock-step turns sample the same trajectories (per-turn seeds)
    assert probe["echo_lockstep_same"] == [True] * len(probe["echo"])


@pytest.mark.slow
def test_the_trainer_logprobs_equal_vllm_at_sampled_positions_and_are_zero_where_inserted(probe):
    # float32: HF vs vLLM CPU forwards over multi-turn contexts (longer than one turn's); 2x the 1e-4 elsewhere
    assert probe["hf_vs_vllm_max_abs"] < 2e-4, probe["hf_vs_vllm_max_abs"]
    assert probe["inserted_logprobs_zero"] == [True] * len(probe["echo"])


@pytest.mark.slow
def test_inserted_tokens_contribute_nothing_to_the_loss_or_its_gradient(probe):
    # two different inserted tails after the last sampled turn: the same loss and gradient, bit for bit
    assert probe["tail_loss"][0] == probe["tail_loss"][1] and probe["tail_grads_equal"] is True, probe["tail_loss"]
    # and no gradient reaches the logits at the positions that predict inserted tokens
    assert probe["inserted_logits_checked"] > 10 and probe["inserted_logit_grad_max"] == 0.0


@pytest.mark.slow
def test_max_turns_ends_a_trajectory_that_keeps_calling_tools(probe):
    assert [s["turns"] for s in probe["forever"]] == [3, 3, 3]
    assert all(s.get("truncations") == 1 for s in probe["forever"]), probe["forever"]


@pytest.mark.slow
def test_a_tool_past_its_timeout_or_raising_is_an_observation_and_the_trajectory_goes_on(probe):
    for t in probe["hang"]:
        assert t["stats"]["tool_timeouts"] == 1 and t["stats"]["turns"] == 2, t
        assert "error: the tool call timed out after 1 s" in t["full"], t["full"]
    for t in probe["raises"]:
        assert t["stats"]["tool_errors"] == 1 and t["stats"]["turns"] == 2, t
        assert "error: RuntimeError: the environment broke" in t["full"], t["full"]


@pytest.mark.slow
def test_model_written_code_that_hangs_crashes_floods_or_dials_out_is_cut_off(probe, server):
    code = probe["code"]
    assert code["hang"]["stats"]["tool_timeouts"] == 1 and "[timeout]" in code["hang"]["full"]
    assert code["crash"]["stats"]["tool_errors"] == 1 and "[killed]" in code["crash"]["full"]
    # 10 MB of output is cut to the tool's 4 KiB, which still exceeds this trajectory's budget: truncated
    assert code["flood"]["stats"]["tool_errors"] == 1 and code["flood"]["stats"]["truncations"] == 1
    assert code["network"]["stats"]["tool_errors"] == 1
    assert server[1] == [], "model-written code reached the test's loopback server"
    for t in code.values():  # every trajectory ended normally and holds only sampled or inserted tokens
        assert len(t["mask"]) == len(t["ids"]) and sum(t["mask"]) == t["stats"]["sampled_tokens"]


@pytest.mark.slow
def test_a_template_that_rewrites_earlier_turns_ends_the_trajectory_before_the_break(probe):
    for t in probe["prefix_break"]:
        assert t["stats"]["prefix_breaks"] == 1 and t["stats"]["turns"] == 1, t
        assert t["mask"] == [1] * len(t["ids"]), t  # nothing inserted from the altered rendering
