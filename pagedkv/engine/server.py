"""`pagedkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

    POST /v1/completions, /v1/chat/completions   (stream=true: server-sent events)
    GET  /v1/models, /health, /metrics (Prometheus text)

A request is validated before anything is queued: a bad one gets HTTP 400 with an OpenAI-style error
body and never reaches the engine. A client that disconnects has its request aborted, which frees its
blocks at the next step boundary.
"""


import argparse
import asyncio
import json
import re
import sys
import time

from ..errors import PagedKVError

SSE_DONE = "data: [DONE]\n\n"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def build_app(llm, served_model_names: list[str]):
    """The FastAPI app serving `llm` (a `pagedkv.LLM`) under the given model names."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import ValidationError

    from . import metrics, protocol
    from .async_llm import AsyncLLM

    engine = AsyncLLM(llm.engine)
    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None)
    schemas: dict = {}  # the request bodies' nested models, for /openapi.json (bodies are parsed by `parse`)
    app.state.engine = engine
    started = int(time.time())
    http_errors = {"count": 0}

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest):
        http_errors["count"] += 1
        return JSONResponse(protocol.error_body(str(exc), param=exc.param, code=exc.code), status_code=400)

    async def parse(request: Request, model_cls):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        try:
            req = model_cls.model_validate(body)
        except ValidationError as exc:
            # of a union's errors (the prompt's forms) the one that is not a mere type mismatch, and the field's
            # path without pydantic's union tags ("constrained-str", "list[int]")
            errors = exc.errors()
            err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
            where = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "-" in p))) or "body"
            if err["type"] == "extra_forbidden":
                raise BadRequest(f"the field {where!r} is not supported by this server; leave it out", param=where,
                                 code="unsupported_field") from None
            raise BadRequest(f"invalid request: {where}: {err['msg']}", param=where) from None
        if req.model not in served_model_names:
            raise BadRequest(f"the model {req.model!r} does not exist; this server serves "
                             f"{', '.join(repr(n) for n in served_model_names)}", param="model", code="model_not_found")
        return req

    def start(prompts: list, req) -> list:
        """Validate and queue every prompt (all or none)."""
        streams = []
        try:
            params = req.sampling_params(None)
            for prompt in prompts:
                streams.append(engine.add_request(prompt, params, stream=req.stream))
        except PagedKVError as exc:
            for s in streams:
                s.close()
            param = re.match(r"(\w+)=", str(exc))
            raise BadRequest(str(exc), param=param.group(1) if param else None) from None
        return streams

    async def collect(streams: list, request: Request):
        """The final output of each stream, or None if the client went away first (then all are aborted)."""
        async def finals():
            outs = []
            for s in streams:
                last = None
                async for last in s:
                    pass
                outs.append(last)
            return outs

        async def disconnected():
            while not await request.is_disconnected():
                await asyncio.sleep(0.5)

        done_task, watch = asyncio.ensure_future(finals()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([done_task, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not done_task.done():
                done_task.cancel()
                for s in streams:
                    s.close()
        return done_task.result() if done_task.done() and not done_task.cancelled() else None

    def check_errors(outputs):
        for o in outputs:
            if o.error:
                raise BadRequest(f"generation failed: {o.error}", code="generation_error")

    @app.post("/v1/completions", openapi_extra=_openapi_body(protocol.CompletionRequest, served_model_names,
                                                                       schemas))
    async def completions(request: Request):
        req = await parse(request, protocol.CompletionRequest)
        prompts = req.prompts()
        if not prompts:
            raise BadRequest("prompt is empty", param="prompt")
        if req.stream and len(prompts) != 1:
            raise BadRequest("streaming takes one prompt per request", param="prompt")
        if req.stream and req.echo:
            raise BadRequest("echo is not implemented with stream=true; ask without streaming", param="echo")
        request_id = protocol.new_id("cmpl")
        streams = start(prompts, req)
        if not req.stream:
            outputs = await collect(streams, request)
            if outputs is None:
                return JSONResponse({}, status_code=499)
            check_errors(outputs)
            return protocol.completion_response(request_id, req.model, outputs, req, llm.tokenizer)
        return StreamingResponse(_stream_completion(streams[0], request_id, req), media_type="text/event-stream")

    async def _stream_completion(stream, request_id, req):
        sent, sent_tokens, ended, last = [0] * req.n, [0] * req.n, [False] * req.n, None  # per sample
        try:
            async for out in stream:
                last = out
                if out.error:
                    yield _sse(protocol.error_body(out.error, kind="server_error"))
                    break
                for done in out.outputs:
                    i, text = done.index, done.text
                    if len(text) > sent[i] or (done.finish_reason and not ended[i]):
                        logprobs = None
                        if done.logprobs is not None:  # the tokens that arrived since the last chunk
                            logprobs = protocol.completion_logprobs(done.logprobs[sent_tokens[i]:],
                                                                    done.token_ids[sent_tokens[i]:], req.logprobs,
                                                                    llm.tokenizer, text_offset=sent[i])
                            sent_tokens[i] = len(done.token_ids)
                        yield _sse(protocol.completion_chunk(request_id, req.model, text[sent[i]:], done.finish_reason,
                                                             logprobs, index=i))
                        sent[i], ended[i] = len(text), done.finish_reason is not None
            if req.include_usage and last is not None:
                yield _sse({**protocol.completion_chunk(request_id, req.model, "", None), "choices": [],
                            "usage": protocol.usage([last])})
            yield SSE_DONE
        finally:
            stream.close()

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(protocol.ChatCompletionRequest, served_model_names,
                                                                            schemas))
    async def chat_completions(request: Request):
        req = await parse(request, protocol.ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = llm.apply_chat_template(messages)
        except PagedKVError as exc:
            raise BadRequest(str(exc), param="messages") from None
        except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
            raise BadRequest(f"the chat template cannot format these messages: {exc}", param="messages") from None
        request_id = protocol.new_id("chatcmpl")
        (stream,) = start([prompt], req)
        if not req.stream:
            outputs = await collect([stream], request)
            if outputs is None:
                return JSONResponse({}, status_code=499)
            check_errors(outputs)
            return protocol.chat_response(request_id, req.model, outputs[0], llm.tokenizer)
        return StreamingResponse(_stream_chat(stream, request_id, req), media_type="text/event-stream")

    async def _stream_chat(stream, request_id, req):
        sent, sent_tokens, ended, last = [0] * req.n, [0] * req.n, [False] * req.n, None  # per sample
        try:
            for i in range(req.n):
                yield _sse(protocol.chat_chunk(request_id, req.model, {"role": "assistant", "content": ""}, None,
                                               index=i))
            async for out in stream:
                last = out
                if out.error:
                    yield _sse(protocol.error_body(out.error, kind="server_error"))
                    break
                for done in out.outputs:
                    i, text = done.index, done.text
                    if len(text) > sent[i]:
                        logprobs = None
                        if done.logprobs is not None:  # the tokens that arrived since the last chunk
                            logprobs = protocol.chat_logprobs(done.logprobs[sent_tokens[i]:], llm.tokenizer)
                            sent_tokens[i] = len(done.logprobs)
                        yield _sse(protocol.chat_chunk(request_id, req.model, {"content": text[sent[i]:]}, None,
                                                       logprobs, index=i))
                        sent[i] = len(text)
                    if done.finish_reason and not ended[i]:
                        yield _sse(protocol.chat_chunk(request_id, req.model, {}, done.finish_reason, index=i))
                        ended[i] = True
            if req.include_usage and last is not None:
                yield _sse({**protocol.chat_chunk(request_id, req.model, {}, None), "choices": [],
                            "usage": protocol.usage([last])})
            yield SSE_DONE
        finally:
            stream.close()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": started, "owned_by": "pagedkv"}
                                           for name in served_model_names]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        extra = {"pagedkv_http_bad_requests_total": ("counter", "Requests refused with HTTP 400.", http_errors["count"])}
        return PlainTextResponse(metrics.render(engine.stats, extra), media_type="text/plain; version=0.0.4")

    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            default_openapi().setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema

    app.openapi = openapi
    return app


def _openapi_body(model_cls, served_model_names: list[str], schemas: dict) -> dict:
    """The OpenAPI request body of a route taking `model_cls` as JSON (its nested models go to `schemas`)."""
    schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schema["properties"]["model"]["enum"] = list(served_model_names)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def serve(llm, args: argparse.Namespace, device: str) -> int:
    """Serve `llm` on --host/--port until interrupted."""
    import uvicorn

    names = args.served_model_name or [args.model]
    app = build_app(llm, names)
    print(f"pagedkv: serving {', '.join(names)} on http://{args.host}:{args.port}/v1 "
          f"(page format {llm.engine.cache.config.kv_format}, {device})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:  # the engine thread ends its step and stops before anything else (a tensor-parallel release) runs
        app.state.engine.shutdown()
    return 0
