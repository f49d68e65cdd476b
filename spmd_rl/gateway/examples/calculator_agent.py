"""The calculator task as an OpenAI tool-calling agent (``configs/quickstart_agent.yaml``).

The agent offers one tool, ``calc``, by its JSON schema; while the model calls it, the agent
evaluates the expression (``envs.calculator.evaluate``: integer arithmetic from its syntax tree,
nothing executed) and sends the value back as a ``tool`` message; the model's first answer
without a call ends the loop. It returns nothing, so the run's reward rule scores that answer.
Nothing here knows about the trainer: the same function runs against any OpenAI-compatible
server.

    python -m spmd_rl.gateway.examples.calculator_agent   # OPENAI_BASE_URL, OPENAI_API_KEY, a row on stdin
"""

from __future__ import annotations

import json
import sys

from openai import BadRequestError

from spmd_rl.gateway import examples
from spmd_rl.envs.calculator import evaluate

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Integer arithmetic: + - * // % and parentheses.",
        "parameters": {"type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]},
    },
}
MAX_CALLS = 1
"""Tool calls before the answer: the call, then the answer, as `rollout.max_turns: 2` in quickstart_tools.yaml."""


def tool_result(call) -> str:
    try:
        return str(evaluate(json.loads(call.function.arguments)["e"]))
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def run(base_url: str, api_key: str, row: dict) -> None:
    client = examples.client(base_url, api_key)
    model = examples.served_model(client)
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    for turn in range(MAX_CALLS + 1):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=[CALC]).choices[0]
        except BadRequestError:  # the trajectory's token budget is spent (counted as a truncation)
            return None
        if not reply.message.tool_calls or turn == MAX_CALLS:
            return None
        messages.append(reply.message.model_dump(exclude_none=True))
        for call in reply.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(call)})
    return None


if __name__ == "__main__":
    import os

    run(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], json.loads(sys.stdin.readline()))
