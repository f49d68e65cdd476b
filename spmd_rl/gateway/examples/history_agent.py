"""An agent that edits its history: after its first answer it starts over with a system message
that summarizes what it said, as summarizing or memory-managing agents do. The second call's
prompt is not the first call's context plus what was served, so the gateway splits the
trajectory (``agent_splits``) and trains the last segment (docs/agents.md)."""

from __future__ import annotations

from spmd_rl.gateway import examples


def run(base_url: str, api_key: str, row: dict) -> None:
    client = examples.client(base_url, api_key)
    model = examples.served_model(client)
    question = {"role": "user", "content": row["prompt"]}
    first = client.chat.completions.create(model=model, messages=[question], max_tokens=8)
    said = first.choices[0].message.content or ""
    summary = {"role": "system", "content": f"you said {said[:8]}"}
    client.chat.completions.create(model=model, messages=[summary, question], max_tokens=8)
    return None
