"""The built-in ``calculator`` environment's conversation as an agent (no tool schema): the model
writes ``<calc>EXPR</calc>``, the agent sends the value back as a ``tool`` message, the model
answers. Run against the gateway with the tiny tool model (``assets/tiny-tools``), it holds the
same conversation as ``rollout.environment: calculator``, with the same seeds: the two paths sample
the same tokens, which ``tools/bench_gateway.py`` and ``tests/integration/test_gateway_http.py``
use to compare them."""

from __future__ import annotations

from openai import BadRequestError

from spmd_rl.gateway import examples
from spmd_rl.envs.calculator import CALL, evaluate

MAX_TURNS = 2


def run(base_url: str, api_key: str, row: dict) -> None:
    client = examples.client(base_url, api_key)
    model = examples.served_model(client)
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(MAX_TURNS):
        try:
            text = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
        except BadRequestError:  # the trajectory's token budget is spent (counted as a truncation)
            return None
        calls = CALL.findall(text)
        if not calls or turn + 1 == MAX_TURNS:
            return None
        try:
            value = str(evaluate(calls[-1]))
        except (ValueError, ZeroDivisionError) as exc:
            value = f"error: {exc}"
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": value}]
    return None
