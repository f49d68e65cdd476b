"""Agents the gateway's tests run (``tests/integration/test_gateway_http.py``): ordinary code
against an OpenAI endpoint, with the ``openai`` client or plain ``httpx``. They run in the agent
host's process, so what they saw goes to the JSON-lines file ``$SPMD_RL_TEST_SEEN`` (``seen``)."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
from openai import OpenAI

_ACTIVE, _LOCK = [0], threading.Lock()
STRAGGLE_S = 8.0


def _keep(key: str, value) -> None:
    """Append to ``$SPMD_RL_TEST_SEEN`` (nothing where it is unset: the trainer's runs)."""
    if "SPMD_RL_TEST_SEEN" not in os.environ:
        return
    with _LOCK, open(os.environ["SPMD_RL_TEST_SEEN"], "a") as f:
        f.write(json.dumps({"key": key, "value": value}) + "\n")


def seen(path) -> dict[str, list]:
    """What each agent saw, by its API key (the tests compare it with the gateway's record);
    ``"active"``: how many ``echo`` agents were running as each started."""
    out: dict[str, list] = {"active": []}
    for line in open(path):
        got = json.loads(line)
        if got["key"] == "active":
            out["active"].append(got["value"])
        else:
            out[got["key"]] = got["value"]
    return out


def straggler(base_url: str, api_key: str, row: dict) -> None:
    """One call, then longer than the phase's timeout."""
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="tiny-agent", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    time.sleep(STRAGGLE_S)


def echo(base_url: str, api_key: str, row: dict) -> float:
    """Two calls: an answer, then (after a tool message) another; keeps each reply's tokens' log-probs."""
    with _LOCK:
        _ACTIVE[0] += 1
        now = _ACTIVE[0]
    _keep("active", now)
    try:
        return _echo(base_url, api_key, row)
    finally:
        with _LOCK:
            _ACTIVE[0] -= 1


def _echo(base_url: str, api_key: str, row: dict) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": row["prompt"]}]
    got = []
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, logprobs=True)
        choice = reply.choices[0]
        got.append([t.logprob for t in choice.logprobs.content])
        messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "content": "ok"}]
    _keep(api_key, got)
    return 0.5


def streams(base_url: str, api_key: str, row: dict) -> None:
    """The same greedy question twice, streamed and not: the texts must agree."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    ask = dict(model="tiny-agent", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=8)
    whole = client.chat.completions.create(**ask).choices[0].message.content
    parts = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    chunks = list(parts)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _keep(api_key, [whole, streamed, chunks[-1].usage.completion_tokens])


def _hostile(url: str, key: str) -> list[tuple[str, int]]:
    """(what was sent, the status it got) for each malformed or hostile request."""
    chat = f"{url}/chat/completions"
    ok = {"model": "tiny-agent", "messages": [{"role": "user", "content": "1*2="}], "max_tokens": 2}
    auth = {"Authorization": f"Bearer {key}"}
    tries = [
        ("no key", lambda c: c.post(chat, json=ok)),
        ("wrong key", lambda c: c.post(chat, json=ok, headers={"Authorization": "Bearer nope"})),
        ("not json", lambda c: c.post(chat, content=b"{", headers=auth)),
        ("a list", lambda c: c.post(chat, content=b"[1, 2]", headers=auth)),
        ("bad utf-8", lambda c: c.post(chat, content=b"\xff\xfe{", headers=auth)),
        ("unknown field", lambda c: c.post(chat, json=ok | {"temprature": 1}, headers=auth)),
        ("wrong model", lambda c: c.post(chat, json=ok | {"model": "gpt-4"}, headers=auth)),
        ("no messages", lambda c: c.post(chat, json=ok | {"messages": []}, headers=auth)),
        ("messages not a list", lambda c: c.post(chat, json=ok | {"messages": "hi"}, headers=auth)),
        ("bad role", lambda c: c.post(chat, json=ok | {"messages": [{"role": "root", "content": "x"}]}, headers=auth)),
        (
            "content a number",
            lambda c: c.post(chat, json=ok | {"messages": [{"role": "user", "content": 3}]}, headers=auth),
        ),
        ("too many messages", lambda c: c.post(chat, json=ok | {"messages": ok["messages"] * 300}, headers=auth)),
        ("max_tokens 0", lambda c: c.post(chat, json=ok | {"max_tokens": 0}, headers=auth)),
        ("max_tokens a string", lambda c: c.post(chat, json=ok | {"max_tokens": "9"}, headers=auth)),
        ("n 1000", lambda c: c.post(chat, json=ok | {"n": 1000}, headers=auth)),
        ("n -1", lambda c: c.post(chat, json=ok | {"n": -1}, headers=auth)),
        ("temperature 9", lambda c: c.post(chat, json=ok | {"temperature": 9}, headers=auth)),
        ("five stops", lambda c: c.post(chat, json=ok | {"stop": ["a", "b", "c", "d", "e"]}, headers=auth)),
        ("penalty", lambda c: c.post(chat, json=ok | {"frequency_penalty": 1.0}, headers=auth)),
        ("forced tool", lambda c: c.post(chat, json=ok | {"tool_choice": "required"}, headers=auth)),
        ("malformed tool", lambda c: c.post(chat, json=ok | {"tools": [{"type": "function"}]}, headers=auth)),
        ("top_logprobs", lambda c: c.post(chat, json=ok | {"top_logprobs": 5}, headers=auth)),
        ("huge body", lambda c: c.post(chat, json=ok | {"user": "x" * (2 << 20)}, headers=auth)),
        (
            "huge body, no length",
            lambda c: c.post(chat, content=iter([b'{"user": "', b"x" * (2 << 20), b'"}']), headers=auth),
        ),
        (
            "prompt past the context",
            lambda c: c.post(chat, json=ok | {"messages": [{"role": "user", "content": "9" * 400}]}, headers=auth),
        ),
        (
            "token ids out of the vocabulary",
            lambda c: c.post(f"{url}/completions", json={"model": "tiny-agent", "prompt": [5, 10**9]}, headers=auth),
        ),
        (
            "empty completion prompt",
            lambda c: c.post(f"{url}/completions", json={"model": "tiny-agent", "prompt": ""}, headers=auth),
        ),
        (
            "echo",
            lambda c: c.post(
                f"{url}/completions", json={"model": "tiny-agent", "prompt": "1", "echo": True}, headers=auth
            ),
        ),
        ("GET a POST route", lambda c: c.get(chat, headers=auth)),
        ("unknown route", lambda c: c.post(f"{url}/embeddings", json={}, headers=auth)),
        ("models without a key", lambda c: c.get(f"{url}/models")),
        ("deep nesting", lambda c: c.post(chat, content=b"[" * 100_000 + b"]" * 100_000, headers=auth)),
    ]
    out = []
    with httpx.Client(timeout=60) as c:
        for name, send in tries:
            out.append((name, send(c).status_code))
        with c.stream("POST", chat, json=ok | {"stream": True, "max_tokens": 30}, headers=auth) as r:
            next(r.iter_lines())  # a client that leaves mid-stream
        out.append(("left mid-stream", r.status_code))
    return out


def hostile(base_url: str, api_key: str, row: dict) -> None:
    """Every hostile request, then a good one: the rank must still answer it."""
    answered = _hostile(base_url, api_key)
    good = OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="tiny-agent", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    _keep(api_key, [answered, good.choices[0].finish_reason])


def crasher(base_url: str, api_key: str, row: dict) -> None:
    """One call, then the agent's whole process exits (as a segfault in a native library would)."""
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="tiny-agent", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    os._exit(3)
