"""The gateway's HTTP side: an OpenAI-compatible server (FastAPI on uvicorn, in a thread of
the rank) in front of the rank's rollout engine.

Per request: the gate (503 with ``Retry-After`` outside the generation phase), the bearer key
(401 unless the trainer issued it for a trajectory that is still running), the body (413 over
``rollout.gateway.max_request_kib``; 400 naming the field for malformed JSON, unknown or
unsupported fields, too many messages, a template that cannot render the messages, or a
prompt past the trajectory's token budget; 404 for another model's name), then one render, one
tokenization and the samples from ``EnginePump``. The exact tokens are recorded in the
trajectory's ``AgentRecord``. Nothing a client sends reaches the rank's thread as an exception:
the engine is only ever given token ids within its limits.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import Counter
from dataclasses import dataclass

from spmd_rl.data.sampling import Sample, SamplingSpec
from spmd_rl.envs.multi_turn import request_seed
from spmd_rl.gateway import protocol, toolcalls
from spmd_rl.gateway.pump import EnginePump, PhaseClosed
from spmd_rl.gateway.records import AgentRecord, Plan

log = logging.getLogger("spmd_rl")


class Refused(Exception):
    """A request answered with an error status (never a rank's failure)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, protocol.error(message, kind, param, code)
        self.headers = {"Retry-After": "1"} if status == 503 else {}


@dataclass(frozen=True)
class Phase:
    """How the open generation phase samples: the run's temperature and top-p, the seed its
    requests derive from (None: unseeded) and the policy version the engine holds."""

    temperature: float
    top_p: float | None
    seed: int | None
    version: int


@dataclass
class Lease:
    """One trajectory's key: its record and what its requests' seeds derive from."""

    record: AgentRecord
    seed_key: int


@dataclass(frozen=True)
class Limits:
    model: str
    """The one model name served (``/v1/models``)."""
    max_model_len: int
    response_budget: int
    """``rollout.max_response_length``: a trajectory's response tokens (sampled + inserted)."""
    max_request_bytes: int
    max_messages: int
    tool_parser: str


class Gateway:
    def __init__(self, tokenizer, pump: EnginePump, limits: Limits):
        self.tokenizer, self.pump, self.limits = tokenizer, pump, limits
        self.phase: Phase | None = None
        self.leases: dict[str, Lease] = {}
        self.answered: Counter = Counter()
        """Responses by status code (what the fuzz test and the metrics read)."""
        self._ids = itertools.count()
        self.server = None
        """The uvicorn server (``app.serve``)."""
        self.base_url = ""

    # -- the trainer's side ------------------------------------------------------------------
    def open(self, phase: Phase, leases: dict[str, Lease]) -> None:
        self.leases, self.phase = dict(leases), phase
        self.pump.phase = phase

    def close(self) -> None:
        """End the phase: every key issued for it is dead, and a request that passed its key
        check but had not reached the engine is answered 503."""
        self.phase, self.leases = None, {}
        self.pump.phase = None
        self.pump.drain()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    # -- the handlers' side ------------------------------------------------------------------
    def lease(self, authorization: str | None) -> tuple[Phase, Lease]:
        phase = self.phase
        if phase is None:
            raise Refused(503, "no generation phase is open: retry after the update", "unavailable")
        key = (authorization or "").removeprefix("Bearer ").strip()
        found = self.leases.get(key)
        if not key or found is None:
            raise Refused(401, "a key the trainer issued for a running trajectory is needed", "authentication_error")
        return phase, found

    def request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def budget(self, plan: Plan, requested: int | None, record: AgentRecord) -> int:
        """Tokens this call may sample: what the trajectory's response budget, the engine's
        context and the request leave; a 400 when nothing is left (the trajectory's
        ``truncations``, as an in-process trajectory whose observation leaves no room)."""
        lim = self.limits
        left = min(lim.response_budget - plan.response_so_far, lim.max_model_len - len(plan.prompt))
        if left < 1:
            with record.lock:
                record.stats["truncations"] += 1
            raise Refused(
                400,
                f"the trajectory's budget is spent: {len(plan.prompt)} prompt tokens, {plan.response_so_far} of "
                f"{lim.response_budget} response tokens (rollout.max_response_length), context {lim.max_model_len}",
                "invalid_request_error",
                "messages",
                "context_length_exceeded",
            )
        return left if requested is None else min(left, requested)

    async def sample(self, phase: Phase, lease: Lease, prompt: list[int], max_tokens: int, n: int) -> list[Sample]:
        call = lease.record.call_number()
        seed = None if phase.seed is None else request_seed(phase.seed, lease.seed_key, call)
        spec = SamplingSpec(max_tokens, phase.temperature, seed, n, phase.top_p)
        try:
            return await asyncio.wrap_future(self.pump.ask(prompt, spec, phase))
        except PhaseClosed:
            raise Refused(503, "the generation phase closed: retry after the update", "unavailable") from None

    def cut_at_stop(self, sample: Sample, stops: list[str] | None) -> tuple[Sample, str]:
        """The sample cut after the token that completes its first stop string (the tokens past
        it are not served and not trained), and its text before the stop string."""
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        hits = [text.find(s) for s in stops or () if s in text]
        if not hits:
            return sample, text
        at = min(hits)
        for k in range(1, len(sample.token_ids) + 1):
            if len(self.tokenizer.decode(sample.token_ids[:k], skip_special_tokens=True)) > at:
                break
        cut = Sample(sample.token_ids[:k], sample.logprobs[:k], True)
        return cut, text[:at]

    def parse(self, text: str, parse_tools: bool, rid: str) -> toolcalls.Parsed:
        return toolcalls.parse(text, self.limits.tool_parser if parse_tools else "none", rid)

    def token_logprobs(self, sample: Sample) -> list[dict]:
        out = []
        for t, lp in zip(sample.token_ids, sample.logprobs):
            s = self.tokenizer.decode([t])
            out.append({"token": s, "logprob": float(lp), "bytes": list(s.encode()), "top_logprobs": []})
        return out

    def render(self, tools: list[dict] | None):
        """(messages, with the generation prompt) -> token ids, with these tools."""

        def render(messages: list[dict], generation: bool) -> list[int]:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=False
                )
            )

        return render


def parse_body(raw: bytes, model: type, max_messages: int | None = None):
    """A request body as ``model``, or a 400 naming what is wrong."""
    from pydantic import ValidationError

    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Refused(400, f"the body is not JSON: {exc}", "invalid_request_error") from None
    except RecursionError:
        raise Refused(400, "the body nests too deeply", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise Refused(400, "the body must be a JSON object", "invalid_request_error")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise Refused(400, f"{field}: {first['msg']}", "invalid_request_error", field) from None
    if max_messages is not None and len(req.messages) > max_messages:
        raise Refused(
            400,
            f"{len(req.messages)} messages, more than rollout.gateway.max_messages ({max_messages})",
            "invalid_request_error",
            "messages",
        )
    return req
