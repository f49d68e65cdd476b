"""What a dataset row holds, read the way the verl / HF layouts write it:

- a field addressed by a dotted path (``reward_model.ground_truth``), through nested objects;
- a prompt that is a string (one user turn) or a list of ``{role, content}`` messages (system,
  user and earlier assistant turns), with ``data.system_prompt`` put first when the row has no
  system message of its own.

A value of the wrong shape is refused with ``BadRow``, naming the file, the row and the field
(never turned into its Python repr); a field that is absent is ``MISSING`` and the caller
decides (the prompt loader skips the row and counts it).
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "tool")
"""The message roles a prompt may hold (a chat template renders each)."""

MISSING = object()
"""The value at a path that the row does not have."""


class BadRow(ValueError):
    """A row whose field cannot be what the config says; the message names the file, the row,
    the field and the fix."""

    def __init__(self, where: str, field: str, problem: str, fix: str) -> None:
        super().__init__(f"{where}, field {field!r}: {problem}; {fix}")


def field_at(row: dict, path: str) -> Any:
    """The value at dotted ``path`` of ``row`` (``a.b`` is ``row["a"]["b"]``); ``MISSING`` where
    a part is absent or None. A top-level key that itself holds a dot is found first."""
    if path in row:
        return MISSING if row[path] is None else row[path]
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return MISSING
        node = node[part]
    return node


def text_at(row: dict, path: str, where: str) -> Any:
    """A string field (the answer, a response): a string, or a number written as its text; any
    other shape is ``BadRow``. ``MISSING`` passes through."""
    value = field_at(row, path)
    if value is MISSING or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise BadRow(where, path, f"holds a {type(value).__name__}, not text", "point the field at a string column")


def messages_at(row: dict, path: str, where: str, system_prompt: str | None) -> Any:
    """The prompt at ``path`` as chat messages: a string is one user turn; a list must hold
    ``{role, content}`` objects with a known role and string content (numpy arrays from parquet
    are lists too). ``system_prompt`` goes first unless the row starts with a system message.
    ``MISSING`` passes through."""
    value = field_at(row, path)
    if value is MISSING:
        return value
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray":
        messages = [_message(m, k, path, where) for k, m in enumerate(value)]
        if not messages:
            raise BadRow(where, path, "is an empty message list", "give the prompt at least one user message")
    else:
        raise BadRow(
            where, path, f"holds a {type(value).__name__}", "give a string or a list of {role, content} messages"
        )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _message(m: Any, k: int, path: str, where: str) -> dict[str, str]:
    if not isinstance(m, dict):
        raise BadRow(where, f"{path}[{k}]", f"is a {type(m).__name__}", "write each message as {role, content}")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        problem = "has no role" if role is None else f"has role {role!r}"
        raise BadRow(where, f"{path}[{k}]", problem, f"use one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise BadRow(where, f"{path}[{k}].content", f"is a {type(content).__name__}", "write the content as text")
    return {"role": role, "content": content}


def plain_text(messages: list[dict[str, str]], where: str, path: str) -> str:
    """The prompt as bare text (``data.apply_chat_template: false``): one user turn's content;
    several messages cannot be joined without a template."""
    if len(messages) != 1 or messages[0]["role"] != "user":
        raise BadRow(
            where, path, f"holds {len(messages)} messages", "set data.apply_chat_template: true to render them"
        )
    return messages[0]["content"]
