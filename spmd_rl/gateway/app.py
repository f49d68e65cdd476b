"""The gateway's routes (FastAPI): ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.
Each is the same steps (``server`` module docstring); what differs is how the prompt is made
(the chat template over messages and tools, or the text as it is) and the body returned."""

from __future__ import annotations

import json
import logging
import socket
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from spmd_rl.gateway import protocol
from spmd_rl.gateway.server import Gateway, Refused, parse_body

log = logging.getLogger("spmd_rl")


async def bounded_body(request: Request, limit: int) -> bytes:
    """The body, read up to ``limit`` bytes: a 413 past it, whatever Content-Length claims."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"the body is over {limit} bytes (rollout.gateway.max_request_kib)", "invalid_request_error")
    got = bytearray()
    async for chunk in request.stream():
        got += chunk
        if len(got) > limit:
            raise Refused(
                413, f"the body is over {limit} bytes (rollout.gateway.max_request_kib)", "invalid_request_error"
            )
    return bytes(got)


def make_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="spmd-rl agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        gw.answered[exc.status] += 1
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:  # the gateway's own fault: logged, a 500
        log.exception("the gateway failed a request: %s", exc)
        gw.answered[500] += 1
        return JSONResponse(protocol.error("the gateway failed this request", "server_error"), status_code=500)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        gw.lease(request.headers.get("authorization"))
        gw.answered[200] += 1
        card = {"id": gw.limits.model, "object": "model", "created": 0, "owned_by": "spmd-rl"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve_chat(gw, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve_completion(gw, request)

    return app


async def serve_chat(gw: Gateway, request: Request):
    """One chat completion: messages and tools through the chat template, tool calls parsed."""
    phase, lease = gw.lease(request.headers.get("authorization"))
    req = parse_body(
        await bounded_body(request, gw.limits.max_request_bytes), protocol.ChatRequest, gw.limits.max_messages
    )
    _check_model(gw, req.model)
    messages = [m.as_template() for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        plan = lease.record.plan(messages, gw.render(tools))
    except Exception as exc:  # noqa: BLE001 - the template's refusal of these messages
        raise Refused(
            400, f"the chat template cannot render these messages: {exc}", "invalid_request_error", "messages"
        ) from None
    limit = gw.budget(plan, req.max_completion_tokens or req.max_tokens, lease.record)
    samples = await gw.sample(phase, lease, plan.prompt, limit, req.n)
    rid = gw.request_id("chatcmpl")
    choices, served, completion = [], [], 0
    for k, raw in enumerate(samples):
        sample, text = gw.cut_at_stop(raw, req.stop)
        parsed = gw.parse(text, bool(tools) and req.tool_choice != "none", f"{rid}_{k}")
        lease.record.stats["tool_calls"] += len(parsed.tool_calls)
        lease.record.stats["tool_parse_errors"] += parsed.malformed
        choice = protocol.chat_choice(
            k,
            parsed.content,
            parsed.tool_calls,
            "stop" if sample.stopped else "length",
            gw.token_logprobs(sample) if req.logprobs else None,
        )
        choices.append(choice)
        served.append((sample, choice["message"], text))
        completion += len(sample.token_ids)
    lease.record.record(plan, messages, served, phase.version)
    gw.answered[200] += 1
    if req.stream:
        tail = (
            protocol.usage(len(plan.prompt), completion)
            if req.stream_options and req.stream_options.include_usage
            else None
        )
        return _stream(protocol.chat_chunks(rid, gw.limits.model, choices, tail))
    return JSONResponse(protocol.chat_response(rid, gw.limits.model, choices, len(plan.prompt), completion))


async def serve_completion(gw: Gateway, request: Request):
    """One text completion: the prompt as given (text, or token ids), no template."""
    phase, lease = gw.lease(request.headers.get("authorization"))
    req = parse_body(await bounded_body(request, gw.limits.max_request_bytes), protocol.CompletionRequest)
    _check_model(gw, req.model)
    ids = (
        list(req.prompt) if isinstance(req.prompt, list) else gw.tokenizer.encode(req.prompt, add_special_tokens=False)
    )
    vocab = len(gw.tokenizer)
    if any(not 0 <= t < vocab for t in ids):
        raise Refused(400, f"prompt token ids must lie in [0, {vocab})", "invalid_request_error", "prompt")
    plan = lease.record.plan_tokens(ids)
    limit = gw.budget(plan, req.max_tokens, lease.record)
    samples = await gw.sample(phase, lease, plan.prompt, limit, req.n)
    rid = gw.request_id("cmpl")
    choices, served, completion = [], [], 0
    for k, raw in enumerate(samples):
        sample, text = gw.cut_at_stop(raw, req.stop)
        lp = None
        if req.logprobs:
            lp = {
                "tokens": [gw.tokenizer.decode([t]) for t in sample.token_ids],
                "token_logprobs": list(sample.logprobs),
            }
        choices.append(
            {"index": k, "text": text, "finish_reason": "stop" if sample.stopped else "length", "logprobs": lp}
        )
        served.append((sample, {"role": "assistant", "content": text}, text))
        completion += len(sample.token_ids)
    lease.record.record(plan, [], served, phase.version)
    gw.answered[200] += 1
    body = protocol.completion_response(rid, gw.limits.model, choices, len(plan.prompt), completion)
    if req.stream:
        return _stream([body | {"object": "text_completion"}])
    return JSONResponse(body)


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.limits.model:
        raise Refused(
            404,
            f"the model {model!r} does not exist: this gateway serves {gw.limits.model!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _stream(chunks: list[dict]) -> StreamingResponse:
    async def events():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def serve(gw: Gateway, host: str, port: int) -> str:
    """Serve ``gw`` with uvicorn in a daemon thread; returns the base URL (``http://host:port/v1``)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(
        make_app(gw), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="spmd-rl-gateway")
    thread.start()
    while not server.started and thread.is_alive():
        threading.Event().wait(0.01)
    if not thread.is_alive():
        raise RuntimeError(f"the gateway could not serve on {host}:{port}")
    shown = f"[{host}]" if ":" in host else host
    gw.base_url, gw.server = f"http://{shown}:{sock.getsockname()[1]}/v1", server
    log.info("agent gateway serving %s", gw.base_url)
    return gw.base_url
