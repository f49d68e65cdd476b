"""Agents written against an OpenAI endpoint with the ``openai`` client, as a user writes them:
``rollout.agent: spmd_rl.gateway.examples.calculator_agent:run`` (docs/agents.md).

What they share is what any agent run many times per process should do: one HTTP client for
every agent (a fresh ``OpenAI()`` builds its own, with an SSL context: 33 ms on a 2-core EPYC,
more than the tiny model's whole trajectory, even for the gateway's plain HTTP), and the served
model's name asked once per gateway, not once per trajectory."""

from __future__ import annotations

import threading

from openai import DefaultHttpxClient, OpenAI

HTTP = DefaultHttpxClient()
_MODELS: dict[str, str] = {}
_LOCK = threading.Lock()


def client(base_url: str, api_key: str) -> OpenAI:
    """An ``openai`` client for one trajectory's key, on the shared HTTP client; it retries a
    503 (outside the generation phase) as ``Retry-After`` says."""
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=5, http_client=HTTP)


def served_model(c: OpenAI) -> str:
    """The gateway's one model (``GET /v1/models``), asked once per base URL."""
    key = str(c.base_url)
    with _LOCK:
        if key in _MODELS:
            return _MODELS[key]
    name = c.models.list().data[0].id
    with _LOCK:
        _MODELS[key] = name
    return name
