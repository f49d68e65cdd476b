"""The gateway over real HTTP (uvicorn, the ``openai`` client, httpx) in front of a real engine
(``rollout.engine: hf`` on the tiny agent model): what agents are served is what is recorded, the
recorded log-probs are the trainer's, 256 agents at once lose nothing, streaming serves what a
plain call serves, hostile requests get a 4xx and leave the rank serving, and keys die with their
phase. The trainer's side (two ranks, vLLM, the dock) is ``test_agent_torchrun.py``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.config.loader import load_config
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.base import RolloutBuild
from spmd_rl.engines.rollouts import build_rollout_engine
from spmd_rl.engines.training.logprobs import build_batch, response_logprobs
from spmd_rl.engines.training.token_logprob import SamplingPolicy
from spmd_rl.gateway.records import AgentRecord
from spmd_rl.envs.trajectory import mask_runs
from spmd_rl.gateway.rollout import AgentRollout, agent_rollout
from spmd_rl.gateway.server import Lease, Phase
from tests import gateway_agents
from tests.conftest import REPO

PROMPT_LEN, RESPONSE = 48, 112
SEEN_FILE = Path(tempfile.mkdtemp(prefix="spmd-rl-seen-")) / "seen.jsonl"
os.environ["SPMD_RL_TEST_SEEN"] = str(SEEN_FILE)  # the agent host inherits it


@pytest.fixture(scope="module")
def tok(tiny_agent):
    return AutoTokenizer.from_pretrained(tiny_agent)


def _config(model, *over: str):
    return load_config(
        REPO / "configs/quickstart_agent.yaml",
        [
            f"model.path={model}",
            f"data.train_path={model}/train.jsonl",
            f"data.test_path={model}/test.jsonl",
            "rollout.engine=hf",
            "rollout.gateway.host=127.0.0.1",
            "rollout.gateway.concurrency=256",
            "rollout.gateway.max_request_kib=1024",
            "rollout.gateway.max_messages=256",
            "rollout.gateway.tool_parser=hermes",
            *over,
        ],
    )


@pytest.fixture(scope="module")
def engine(tiny_agent):
    cfg = _config(tiny_agent)
    return build_rollout_engine(
        RolloutBuild(tiny_agent, detect("cpu"), cfg.rollout, 1, "float32", PROMPT_LEN + RESPONSE, distributed=False)
    )


@pytest.fixture(scope="module")
def gateway(tiny_agent, tok, engine):
    out = agent_rollout(_config(tiny_agent), engine, tok, "tiny-agent")
    yield out
    out.close()


def _run(gw: AgentRollout, agent: str, rows: list[str], tok, **kw):
    """The agents' trajectories, and what each agent saw (``tests.gateway_agents.seen``)."""
    gw.use(agent)
    items = [([1, 2], {"prompt": p}) for p in rows]
    SEEN_FILE.write_text("")
    trajs = gw.run(items, seed=5, **kw)
    return trajs, gateway_agents.seen(SEEN_FILE)


def trainer_logprobs(model_path, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    batch = build_batch([torch.tensor(prompt)], [torch.tensor(ids)], 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return response_logprobs(logits, batch, policy=SamplingPolicy(temperature, -1, 1.0))[0][0, : len(ids)]


@pytest.mark.slow
def test_256_agents_at_once_are_served_recorded_exactly_and_scored_by_the_trainer(gateway, tok, tiny_agent):
    rows = [f"{100 + k}*{10 + k % 90}=" for k in range(256)]
    trajs, seen = _run(gateway, "tests.gateway_agents:echo", rows, tok)
    active = seen.pop("active")
    assert len(trajs) == 256 and len(seen) == 256  # no agent lost
    assert max(active) > 128  # rollout.gateway.concurrency: 256 ran at once (the default is 32)
    assert all(t.stats["turns"] == 2 and t.stats.get("agent_splits", 0) == 0 and t.reward == 0.5 for t in trajs)
    by_prompt = {}
    for t in trajs:
        text = tok.decode(t.prompt)
        by_prompt[text] = t
        # the two sampled turns are what was served: the same tokens' log-probs, in order
        assert len([r for r in mask_runs(t.mask) if r[2]]) == 2
    for key, got in seen.items():
        served = [lp for turn in got for lp in turn]
        match = [t for t in trajs if [lp for lp, m in zip(t.logprobs, t.mask) if m] == served]
        assert len(match) == 1, key
    # the trainer's log-probs of the recorded tokens are the sampler's (HF forward, same temperature)
    for t in trajs[:4]:
        ours = trainer_logprobs(tiny_agent, t.prompt, t.ids, 1.0)
        sampled = torch.tensor(t.mask, dtype=torch.bool)
        assert torch.allclose(ours[sampled], torch.tensor(t.logprobs)[sampled], atol=1e-4)
        assert tok.decode(t.prompt + t.ids).count("<|im_start|>tool\nok<|im_end|>") == 1


@pytest.mark.slow
def test_a_streamed_reply_is_the_plain_one(gateway, tok):
    _, seen = _run(gateway, "tests.gateway_agents:streams", ["123*45=", "600*70="], tok, temperature=0.0)
    seen.pop("active")
    assert len(seen) == 2
    for whole, streamed, tokens in seen.values():
        assert whole == streamed and tokens > 0


@pytest.mark.slow
def test_hostile_requests_get_a_4xx_and_the_rank_keeps_serving(gateway, tok):
    _, seen = _run(gateway, "tests.gateway_agents:hostile", ["123*45="], tok)
    seen.pop("active")
    ((answered, finish),) = seen.values()
    codes = dict(answered)
    assert len(answered) >= 30, answered
    bad = {k: v for k, v in codes.items() if not 400 <= v < 500 and k != "left mid-stream"}
    assert not bad, bad
    assert codes["no key"] == codes["wrong key"] == 401 and codes["wrong model"] == 404
    assert codes["huge body"] == codes["huge body, no length"] == 413 and codes["GET a POST route"] == 405
    assert finish in ("stop", "length") and 500 not in gateway.gateway.answered
    print(f"fuzz: {len(answered)} hostile requests, {sorted(set(codes.values()))}")


def test_outside_the_phase_a_call_gets_503_and_a_dead_key_401(gateway):
    url = gateway.gateway.base_url
    body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "1"}]}
    r = httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer old"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    gateway.gateway.open(Phase(1.0, None, None, 0), {"fresh": Lease(AgentRecord(frozenset([2])), 0)})
    try:
        r = httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer old"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.get(f"{url}/models", headers={"Authorization": "Bearer fresh"}).json()["data"][0]["id"]
            == "tiny-agent"
        )
    finally:
        gateway.gateway.close()


@pytest.mark.slow
def test_the_calculator_agent_gets_tool_calls_and_its_tool_results_are_inserted(gateway, tok, tiny_agent, engine):
    rows = [f"{300 + k}*{20 + k}=" for k in range(32)]
    trajs, _ = _run(gateway, "spmd_rl.gateway.examples.calculator_agent:run", rows, tok)
    called = [t for t in trajs if t.stats["tool_calls"]]
    assert called, [dict(t.stats) for t in trajs]
    for t in called:
        text = tok.decode(t.prompt + t.ids)
        assert text.startswith("<|im_start|>system\ntools: calc<|im_end|>") and "<tool_call>" in text, text
        assert "<|im_start|>tool\n" in text and t.stats.get("agent_splits", 0) == 0
    print(f"calculator agent: {len(called)} of {len(trajs)} trajectories called the tool")
    # rollout.gateway.tool_parser=none: the same policy text comes back as text, and the agent stops
    plain = agent_rollout(_config(tiny_agent, "rollout.gateway.tool_parser=none"), engine, tok, "tiny-agent")
    try:
        texts, _ = _run(plain, "spmd_rl.gateway.examples.calculator_agent:run", rows, tok)
    finally:
        plain.close()
    assert all(t.stats["tool_calls"] == 0 and t.stats["turns"] == 1 for t in texts)
    assert any("<tool_call>" in t.last_text for t in texts)


@pytest.mark.slow
def test_a_straggling_agent_is_cut_at_its_timeout_and_keeps_what_was_sampled(tiny_agent, tok, engine):
    slow = agent_rollout(_config(tiny_agent, "rollout.gateway.agent_timeout_s=2"), engine, tok, "tiny-agent")
    try:
        t0 = time.monotonic()
        (traj,), _ = _run(slow, "tests.gateway_agents:straggler", ["123*45="], tok)
        took = time.monotonic() - t0
    finally:
        slow.close()
    assert took < gateway_agents.STRAGGLE_S and traj.stats["agent_failures"] == 1 and len(traj.ids) > 0, took


@pytest.mark.slow
def test_a_command_line_agent_gets_the_url_key_and_row(gateway, tok):
    trajs, _ = _run(gateway, f"{sys.executable} -m spmd_rl.gateway.examples.calculator_agent", ["123*45=", "7*8="], tok)
    assert all(t.stats["turns"] >= 1 and t.stats.get("agent_failures", 0) == 0 for t in trajs), [t.stats for t in trajs]


@pytest.mark.slow
def test_the_gateway_path_samples_what_the_in_process_environment_samples(tiny_tools):
    """The calculator's conversation, once as ``rollout.environment: calculator`` and once as an
    agent over HTTP (``calc_tags_agent``), same model, prompts and seeds: the same tokens, mask
    and log-probs, trajectory by trajectory. A gateway that re-tokenized the agent's text, lost
    the template's separator or seeded calls differently would differ here."""
    from spmd_rl.config.schema import RolloutConfig
    from spmd_rl.envs.factory import environment_factory
    from spmd_rl.envs.multi_turn import MultiTurnRollout, TurnLimits
    from spmd_rl.gateway.rollout import AgentRollout, AgentSettings, end_ids
    from spmd_rl.gateway.server import Limits

    tok = AutoTokenizer.from_pretrained(tiny_tools)
    cfg = RolloutConfig(engine="hf", n=1, max_response_length=64, temperature=1.0)
    engine = build_rollout_engine(
        RolloutBuild(tiny_tools, detect("cpu"), cfg, 1, "float32", 48 + 64, distributed=False)
    )
    rows = [json.loads(line) for line in (tiny_tools / "test.jsonl").read_text().splitlines()[:32]]
    items = [
        (
            list(
                tok.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            ),
            r,
        )
        for r in rows
    ]
    env = MultiTurnRollout(engine, tok, environment_factory("calculator"), TurnLimits(2, 64, 5.0)).run(items, seed=11)
    limits = Limits("tiny-tools", 48 + 64, 64, 1 << 20, 64, "none")
    settings = AgentSettings("spmd_rl.gateway.examples.calc_tags_agent:run", "127.0.0.1", 0, 32, 120)
    over_http = AgentRollout(engine, tok, settings, limits, end_ids(tok))
    try:
        agent = over_http.run(items, seed=11)
    finally:
        over_http.close()
    assert sum(t.stats["tool_calls"] for t in env) > 0 and sum(len(t.mask) - sum(t.mask) for t in agent) > 0
    for e, a in zip(env, agent):
        assert a.prompt == e.prompt and a.ids == e.ids and a.mask == e.mask, (tok.decode(e.ids), tok.decode(a.ids))
        assert a.logprobs == pytest.approx(e.logprobs, abs=1e-4)  # float32 forwards of other batch compositions


@pytest.mark.slow
def test_an_agent_that_kills_its_process_fails_its_phase_and_the_rank_serves_the_next(gateway, tok):
    trajs, _ = _run(gateway, "tests.gateway_agents:crasher", ["123*45=", "7*8="], tok)
    assert all(t.stats["agent_failures"] == 1 for t in trajs), [dict(t.stats) for t in trajs]
    again, seen = _run(gateway, "tests.gateway_agents:echo", ["123*45="], tok)
    assert again[0].stats["turns"] == 2 and again[0].stats.get("agent_failures", 0) == 0
