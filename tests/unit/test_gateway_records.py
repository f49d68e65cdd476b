"""The gateway's logic without a server or an engine: tool calls read from the policy's text,
the trajectory record (continuation by messages and by tokens, the split of an edited history),
the request schema's refusals, the agent loader and the config rules of ``rollout.agent``."""

from __future__ import annotations

import json
import sys

import pytest
from transformers import AutoTokenizer

from spmd_rl.config.loader import load_config
from spmd_rl.data.sampling import Sample
from spmd_rl.gateway import protocol, toolcalls
from spmd_rl.gateway.agents import load_agent, reward_of
from spmd_rl.gateway.records import AgentRecord
from spmd_rl.gateway.rollout import end_ids
from spmd_rl.gateway.server import Refused, parse_body
from spmd_rl.recipe.rules import check
from tests.conftest import REPO

CALL = '<tool_call>{"name": "calc", "arguments": {"e": "12*34"}}</tool_call>'


def test_hermes_calls_become_openai_tool_calls_and_malformed_ones_stay_text():
    got = toolcalls.parse("let me see " + CALL + CALL.replace("12*34", "5"), "hermes", "r")
    assert got.content == "let me see" and got.malformed == 0
    assert [json.loads(c["function"]["arguments"]) for c in got.tool_calls] == [{"e": "12*34"}, {"e": "5"}]
    assert [c["id"] for c in got.tool_calls] == ["call_r_0", "call_r_1"]
    bad = toolcalls.parse(
        '<tool_call>{"name": "calc", "arguments": {"e": </tool_call> and <tool_call>{"x": 1}</tool_call>', "hermes", "r"
    )
    assert bad.tool_calls == [] and bad.malformed == 2 and bad.content.count("<tool_call>") == 2
    assert toolcalls.parse("<tool_call>{unclosed", "hermes", "r").malformed == 1
    assert toolcalls.parse(CALL, "none", "r").content == CALL


def test_llama3_json_calls_and_a_semicolon_inside_a_string():
    got = toolcalls.parse(
        '<|python_tag|>{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "parameters": {}}', "llama3", "q"
    )
    assert got.content is None and [c["function"]["name"] for c in got.tool_calls] == ["f", "g"]
    assert json.loads(got.tool_calls[0]["function"]["arguments"]) == {"a": "x;y"}
    assert toolcalls.parse('{"name": "f", "parameters": {"a": ', "llama3", "q").malformed == 1
    assert toolcalls.parse("the answer is 4", "llama3", "q").content == "the answer is 4"


@pytest.fixture(scope="module")
def tok(tiny_tools):
    return AutoTokenizer.from_pretrained(tiny_tools)


def _render(tok):
    return lambda messages, gen: list(
        tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)
    )


def _served(tok, text: str, stopped: bool = True):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if stopped else [])
    return Sample(ids, [-0.5] * len(ids), stopped)


def test_a_continued_call_keeps_the_sampled_tokens_even_when_the_agent_sends_other_text(tok):
    """The agent echoes the assistant turn with different white space (as a template that
    re-serializes JSON would): the context keeps the sampled tokens, not a re-tokenization."""
    rec, render = AgentRecord(end_ids(tok)), _render(tok)
    first = [{"role": "user", "content": "12*34="}]
    plan = rec.plan(first, render)
    assert plan.tip is None and plan.prompt == render(first, True)
    sampled = _served(tok, "  408 ")
    rec.record(plan, first, [(sampled, {"role": "assistant", "content": "408"}, "408")], version=3)
    second = first + [{"role": "assistant", "content": "408"}, {"role": "tool", "content": "ok"}]
    plan2 = rec.plan(second, render)
    assert (
        plan2.tip is not None
        and plan2.prompt[: len(plan.prompt) + len(sampled.token_ids)] == plan.prompt + sampled.token_ids
    )
    # what follows the sampled end-of-turn token is exactly the template's own continuation
    assert tok.decode(plan2.inserted) == "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    rec.record(plan2, second, [(_served(tok, "done"), {"role": "assistant", "content": "done"}, "done")], version=4)
    tip = rec.trained()
    assert tip.prompt == plan.prompt and tip.ids == sampled.token_ids + plan2.inserted + _served(tok, "done").token_ids
    assert tip.mask == [1] * len(sampled.token_ids) + [0] * len(plan2.inserted) + [1] * 5
    assert tip.logprobs[len(sampled.token_ids)] == 0.0 and tip.versions[0] == 3 and tip.versions[-1] == 4
    assert rec.stats["agent_splits"] == 0 and rec.stats["turns"] == 2


def test_a_cut_choice_gets_its_end_of_turn_token_inserted(tok):
    rec, render = AgentRecord(end_ids(tok)), _render(tok)
    first = [{"role": "user", "content": "1+1="}]
    plan = rec.plan(first, render)
    rec.record(plan, first, [(_served(tok, "22", stopped=False), {"role": "assistant", "content": "22"}, "22")], 0)
    nxt = rec.plan(first + [{"role": "assistant", "content": "22"}, {"role": "user", "content": "sure?"}], render)
    assert nxt.inserted[0] == tok.eos_token_id and nxt.tip is not None


def test_tool_call_arguments_reserialized_by_the_client_still_continue(tok):
    rec, render = AgentRecord(end_ids(tok)), _render(tok)
    first = [{"role": "user", "content": "q"}]
    plan = rec.plan(first, render)
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+2"}'}}
    rec.record(
        plan, first, [(_served(tok, CALL), {"role": "assistant", "content": None, "tool_calls": [call]}, CALL)], 0
    )
    echoed = dict(call, id="other", function={"name": "calc", "arguments": '{ "e" :"1+2" }'})
    nxt = rec.plan(
        first + [{"role": "assistant", "content": "", "tool_calls": [echoed]}, {"role": "tool", "content": "3"}], render
    )
    assert nxt.tip is not None
    changed = dict(call, function={"name": "calc", "arguments": '{"e": "1+3"}'})
    edited = rec.plan(
        first + [{"role": "assistant", "content": "", "tool_calls": [changed]}, {"role": "tool", "content": "4"}],
        render,
    )
    assert edited.tip is None  # different arguments: the agent edited what the policy wrote


def test_an_edited_history_splits_counts_and_trains_the_last_segment(tok):
    rec, render = AgentRecord(end_ids(tok)), _render(tok)
    first = [{"role": "user", "content": "7*8="}]
    plan = rec.plan(first, render)
    one = _served(tok, "54")
    rec.record(plan, first, [(one, {"role": "assistant", "content": "54"}, "54")], 0)
    summary = [{"role": "system", "content": "earlier: 54"}, {"role": "user", "content": "7*8="}]
    plan2 = rec.plan(summary, render)
    assert plan2.tip is None and plan2.prompt == render(summary, True)
    rec.record(plan2, summary, [(_served(tok, "56"), {"role": "assistant", "content": "56"}, "56")], 0)
    assert rec.stats["agent_splits"] == 1 and rec.stats["agent_dropped_tokens"] == len(one.token_ids)
    assert rec.trained().prompt == plan2.prompt and rec.trained().mask == [1] * 3


def test_completions_continue_by_tokens_only(tok):
    rec = AgentRecord(end_ids(tok))
    ids = tok.encode("abc", add_special_tokens=False)
    plan = rec.plan_tokens(ids)
    rec.record(plan, [], [(_served(tok, "de", stopped=False), {"role": "assistant", "content": "de"}, "de")], 0)
    more = ids + tok.encode("de", add_special_tokens=False) + tok.encode("f", add_special_tokens=False)
    assert rec.plan_tokens(more).inserted == tok.encode("f", add_special_tokens=False)
    assert rec.plan_tokens(tok.encode("abd", add_special_tokens=False)).tip is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temprature": 1}, "temprature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(body, field):
    with pytest.raises(Refused) as got:
        parse_body(json.dumps(body).encode(), protocol.ChatRequest, 8)
    assert got.value.status == 400 and got.value.body["error"]["param"] == field, got.value.body


def test_too_many_messages_and_non_json_are_refused():
    many = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 9}
    with pytest.raises(Refused, match="max_messages"):
        parse_body(json.dumps(many).encode(), protocol.ChatRequest, 8)
    for raw in (b"{", b"[1]", b"\xff\xfe"):
        with pytest.raises(Refused) as got:
            parse_body(raw, protocol.ChatRequest, 8)
        assert got.value.status == 400


def test_a_command_agent_gets_the_url_key_and_row_and_its_last_line_is_its_reward(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\nrow = json.loads(sys.stdin.readline())\n"
        "print(os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY'], row['prompt'])\n"
        "print(0.25 if row['prompt'] == 'q' else 1)\n"
    )
    run = load_agent(f"{sys.executable} {script}", timeout_s=30)
    assert run("http://x/v1", "k", {"prompt": "q"}) == 0.25
    failing = load_agent(f"{sys.executable} -c 'raise SystemExit(3)'", timeout_s=30)
    with pytest.raises(RuntimeError, match="exited 3"):
        failing("u", "k", {})
    assert reward_of(None) == 0.0 and reward_of(2) == 2.0
    for bad in ("1", float("nan"), True):
        with pytest.raises(TypeError):
            reward_of(bad)


def _problems(**over) -> list[str]:
    overrides = [f"{k}={v}" for k, v in over.items()]
    cfg = load_config(REPO / "configs/quickstart_agent.yaml", overrides)
    return [v.field for v in check(cfg)[1]]


def test_the_agent_config_validates_and_what_it_cannot_serve_is_refused_by_field(tiny_agent):
    assert _problems() == []
    assert "rollout.agent" in _problems(**{"rollout.agent": "no_such_module:agent"})
    assert _problems(**{"rollout.agent": "python -m spmd_rl.gateway.examples.calculator_agent"}) == []
    assert "rollout.environment" in _problems(**{"rollout.environment": "calculator"})
    assert "stream.partial_tokens" in _problems(**{"stream.partial_tokens": 8})
    assert "rollout.max_turns" in _problems(**{"rollout.max_turns": 3})
    plain = load_config(REPO / "configs/quickstart_tools.yaml", ["rollout.gateway.port=9000"])
    assert "rollout.gateway.port" in [v.field for v in check(plain)[1]]


def test_the_agent_in_docs_is_the_example_the_quickstart_trains():
    doc = (REPO / "docs/agents.md").read_text()
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    source = (REPO / "spmd_rl/gateway/examples/calculator_agent.py").read_text()
    assert block.startswith("def run(") and block in source
    assert "spmd_rl.gateway.examples.calculator_agent:run" in (REPO / "configs/quickstart_agent.yaml").read_text()


class _Instant:
    """An engine that finishes every request at its next step with two tokens."""

    def __init__(self):
        self.queued, self.submitted = [], 0

    def submit(self, requests, specs):
        self.queued += [k for k, _ in requests]
        self.submitted += len(requests)

    def busy(self):
        return bool(self.queued)

    def step(self):
        done, self.queued = self.queued, []
        return [(k, [Sample([5, 6], [-0.1, -0.2], True)]) for k in done]


def test_a_request_of_a_closed_phase_never_reaches_the_engine():
    from spmd_rl.data.sampling import SamplingSpec
    from spmd_rl.gateway.pump import EnginePump, PhaseClosed

    engine = _Instant()
    pump, old, new = EnginePump(engine), object(), object()
    pump.phase = new
    stale, fresh = pump.ask([1], SamplingSpec(2, 1.0), old), pump.ask([1], SamplingSpec(2, 1.0), new)
    pump.run_until(lambda: True)
    assert fresh.result()[0].token_ids == [5, 6] and engine.submitted == 1
    with pytest.raises(PhaseClosed):
        stale.result()
    late = pump.ask([1], SamplingSpec(2, 1.0), new)
    pump.phase = None  # the phase closes with the request still queued
    assert pump.drain() == 1 and engine.submitted == 1
    with pytest.raises(PhaseClosed):
        late.result()
