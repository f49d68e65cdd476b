"""The OpenAI request bodies the gateway accepts, and the response bodies it returns.

Requests are validated field by field (pydantic): a field OpenAI defines that this gateway
cannot honour without changing what the policy samples (penalties, a forced tool choice,
``response_format``, ``top_logprobs``) is refused with a 400 naming it; a field OpenAI does not
define is refused as unknown, so a typo is never silently ignored. ``temperature``, ``top_p`` and
``seed`` are accepted and replaced by the run's: the trainer's log-probs are computed at
``rollout.temperature`` and ``rollout.top_p``, so a sample drawn otherwise would be trained as
if it were not (``docs/agents.md``).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(Strict):
    name: str
    arguments: str | dict = "{}"


class ToolCall(Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list | None = None
    function_call: None = None
    audio: None = None

    def as_template(self) -> dict:
        """The message as a chat template reads it: text content, and tool calls with parsed
        arguments (Qwen's and Llama's templates serialize a dict themselves)."""
        out: dict = {"role": self.role, "content": _text(self.content)}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in self.tool_calls
            ]
        return out


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.text for p in content)
    return content


def _args(call: ToolCall) -> dict | str:
    import json

    a = call.function.arguments
    if isinstance(a, dict):
        return a
    try:
        parsed = json.loads(a)
    except json.JSONDecodeError:
        return a
    return parsed if isinstance(parsed, dict) else a


class FunctionSpec(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """What both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s or len(s) > 256 for s in stops):
            raise ValueError("at most 4 stop strings, each 1 to 256 characters")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v:
            raise ValueError("penalties change the sampled distribution, which the trainer cannot reproduce: omit it")
        return v


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    echo: Literal[False] = False


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_choice(index: int, content: str | None, tool_calls: list[dict], finish: str, logprobs: list | None) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "finish_reason": "tool_calls" if tool_calls else finish,
        "logprobs": None if logprobs is None else {"content": logprobs},
    }


def chat_chunks(rid: str, model: str, choices: list[dict], usage_tail: dict | None) -> list[dict]:
    """A served chat completion as the stream of chunks OpenAI sends: per choice the role, the
    content, the tool calls and the finish reason, then the usage when asked for."""
    created, out = int(time.time()), []

    def chunk(delta: dict, index: int, finish: str | None = None, logprobs=None) -> dict:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }

    for c in choices:
        m = c["message"]
        out.append(chunk({"role": "assistant", "content": ""}, c["index"]))
        if m["content"]:
            out.append(chunk({"content": m["content"]}, c["index"], logprobs=c["logprobs"]))
        if m.get("tool_calls"):
            calls = [dict(tc, index=k) for k, tc in enumerate(m["tool_calls"])]
            out.append(chunk({"tool_calls": calls}, c["index"]))
        out.append(chunk({}, c["index"], c["finish_reason"]))
    if usage_tail is not None:
        out.append(
            {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": []}
            | {"usage": usage_tail}
        )
    return out


def completion_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body (what its clients raise from)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
