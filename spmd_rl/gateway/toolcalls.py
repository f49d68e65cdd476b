"""Tool calls in the policy's text, as OpenAI ``tool_calls``.

Two formats, the two that open chat templates emit:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and most fine-tunes): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text outside the tags is
  the message's content;
- ``llama3`` (Llama 3.1 and 3.2 JSON tool calling): the whole turn is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after ``<|python_tag|>``;
  several calls follow each other, separated by ``;`` or white space.

A call whose JSON does not parse, or that is not an object with a string ``name``, stays in the
content as text and is counted (``malformed``): the agent sees what the policy wrote, and the
gateway never fails a request over the policy's output. The call ids are derived from the
request id and the call's place, so the same request returns the same ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PARSERS = ("hermes", "llama3", "none")


@dataclass
class Parsed:
    content: str | None
    """The text outside the calls (None when the turn is calls only)."""
    tool_calls: list[dict] = field(default_factory=list)
    """OpenAI's shape: ``{"id", "type": "function", "function": {"name", "arguments": str}}``."""
    malformed: int = 0


def _call(obj: object, arguments_key: str, call_id: str) -> dict | None:
    """One OpenAI tool call from a parsed object, or None when it is not a named call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse(text: str, style: str, request_id: str) -> Parsed:
    """The content and tool calls of one sampled turn (``style`` one of ``PARSERS``)."""
    if style == "hermes":
        return _hermes(text, request_id)
    if style == "llama3":
        return _llama3(text, request_id)
    return Parsed(text)


def _hermes(text: str, request_id: str) -> Parsed:
    calls, kept, malformed, last = [], [], 0, 0
    for m in HERMES.finditer(text):
        call = _call(_loads(m.group(1)), "arguments", f"call_{request_id}_{len(calls)}")
        kept.append(text[last : m.start()])
        if call is None:
            malformed += 1
            kept.append(m.group(0))  # the policy's malformed call stays visible as text
        else:
            calls.append(call)
        last = m.end()
    kept.append(text[last:])
    if "<tool_call>" in text[last:]:  # an opened call never closed: text, and counted
        malformed += 1
    content = "".join(kept).strip()
    return Parsed(content or (None if calls else ""), calls, malformed)


def _llama3(text: str, request_id: str) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text)
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return Parsed(text, [], 1)
        call = _call(obj, "parameters", f"call_{request_id}_{len(calls)}")
        if call is None:
            return Parsed(text, [], 1)
        calls.append(call)
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return Parsed(None, calls)
