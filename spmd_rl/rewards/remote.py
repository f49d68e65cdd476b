"""A reward service (``reward.kind: remote``): an LLM judge, a code-execution farm.

Each call POSTs one chunk of the rank's share to ``reward.url`` as JSON

    {"responses": [str], "answers": [str], "rows": [{"prompt", "data_source", "extra_info"}]}

and reads ``{"scores": [score or {"score": s, <metric>: v}]}``, one per response. It is a batched
reward (``rewards.pool`` runs ``reward.workers`` chunks at once, each under
``reward.timeout_s``); the request itself times out at ``reward.timeout_s`` too, so no thread
waits on a dead service for good. A connection error, a timeout, a 5xx or 429 answer, or a body
that is not that JSON is retried ``reward.retries`` times with exponential backoff (0.5 s,
1 s, ...); a 4xx is not (the request itself is wrong). The bearer token is read from the
environment variable ``reward.token_env`` names, never from the config. A reply is read up to
``MAX_REPLY_BYTES``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

MAX_REPLY_BYTES = 64 * 2**20


class RewardServiceError(RuntimeError):
    """A reward request that failed for good; the message names the URL and what came back."""


class RemoteReward:
    def __init__(self, url: str, timeout_s: float, retries: int, token_env: str, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        token = os.environ.get(token_env)
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})

    def __call__(self, responses: list[str], answers: list[str], rows: list[dict]) -> list:
        body = json.dumps({"responses": responses, "answers": answers, "rows": rows}, default=str).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._post(body, len(responses))
            except urllib.error.HTTPError as exc:
                problem = f"HTTP {exc.code} {exc.reason}"
                if 400 <= exc.code < 500 and exc.code != 429:
                    break  # the request is wrong: sending it again will not help
            except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
                problem = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        raise RewardServiceError(f"reward.url {self.url}: {problem} (after {attempt + 1} attempt(s))")

    def _post(self, body: bytes, n: int) -> list:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            raw = reply.read(MAX_REPLY_BYTES + 1)
        if len(raw) > MAX_REPLY_BYTES:
            raise ValueError(f"a reply over {MAX_REPLY_BYTES} bytes")
        scores = json.loads(raw).get("scores") if raw.strip().startswith(b"{") else None
        if not isinstance(scores, list) or len(scores) != n:
            raise ValueError(f"the reply is not {{'scores': [{n} scores]}}: {raw[:80]!r}")
        return scores
