"""A minimal OpenAI-style engine served the way vLLM and SGLang serve: an ASGI app under uvicorn.

It exists for the hostile-input suite: pdgate's own simulator (pdsim) is a Rust server with its own
path handling, while real engines are Python ASGI apps, and that is where the attacks land. What it
imitates, on purpose:

- uvicorn %-decodes the request path before routing (`scope["path"]`), so `POST /v1/%63ompletions`
  reaches the completions handler; the undecoded path stays in `scope["raw_path"]`;
- Starlette's router answers a path with a trailing slash (`/v1/completions/`) with a 307 whose
  `Location` is built from the request's `Host`, i.e. names the engine's own address;
- unknown paths get FastAPI's 404 body `{"detail":"Not Found"}`;
- `/v1/completions` and `/v1/chat/completions` answer JSON or, with `"stream": true`, SSE
  (`data: <json>\\n\\n` ... `data: [DONE]\\n\\n`); a prefill leg (`kv_transfer_params` with
  `do_remote_decode: true`) gets vLLM-shaped `kv_transfer_params` back; `/v1/models`, `/health`,
  `/tokenize`, `/detokenize` and `/v1/embeddings` answer too;
- `--redirect PATH` makes PATH answer a 307 whose `Location` names the engine's own address, for
  testing that a gateway does not relay it.

It records every request it receives, completely or not: method, raw and decoded path, query string,
HTTP version, headers in order, body (text and base64, updated as it arrives: the body is read
whole before routing), whether it arrived to its end, and the response status. Records go to `GET /_recorded` (`{"requests": [...]}`; `DELETE /_recorded`
clears) and, with `--record FILE`, one JSON line per request to FILE when the request ends.
Requests to `/_recorded` are not recorded.

It dials nothing: no outbound connection is ever made, whatever a request asks for.

Run: `python asgi_engine.py [--host 127.0.0.1] [--port 0] [--record FILE] [--model NAME]`.
The first line on stdout is the port it listens on (with `--port 0` the kernel picks one; the
socket is bound before the line is printed, so there is no race).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import sys
import time
import uuid
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

RECORD_PATH = "/_recorded"


class Recorder:
    """Requests seen so far, in arrival order; each one is a dict updated as the request goes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.requests: list[dict[str, Any]] = []
        self.seq = 0

    def start(self, scope: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        record: dict[str, Any] = {
            "seq": self.seq,
            "time": time.time(),
            "method": scope["method"],
            "raw_path": scope.get("raw_path", b"").decode("latin-1"),
            "path": scope["path"],
            "query_string": scope.get("query_string", b"").decode("latin-1"),
            "http_version": scope.get("http_version"),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
            "body": "",
            "body_b64": "",
            "body_complete": False,
            "status": None,
        }
        self.requests.append(record)
        return record

    def finish(self, record: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def set_body(record: dict[str, Any], body: bytes) -> None:
    record["body"] = body.decode("utf-8", errors="replace")
    record["body_b64"] = base64.b64encode(body).decode("ascii")


class Recording:
    """ASGI middleware outside the router: sees every request, including redirected and 404 ones."""

    def __init__(self, app: Any, recorder: Recorder) -> None:
        self.app = app
        self.recorder = recorder

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == RECORD_PATH:
            await self.app(scope, receive, send)
            return
        record = self.recorder.start(scope)
        # The whole body is read before the app runs (as FastAPI's `await request.json()` does), so
        # the record shows every byte that arrived even for requests the router turns away.
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client went away mid-body: nothing to route.
                self.recorder.finish(record)
                return
            body.extend(message.get("body", b""))
            set_body(record, bytes(body))
            if not message.get("more_body", False):
                record["body_complete"] = True
                break
        replayed = False

        async def recording_receive() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        async def recording_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            self.recorder.finish(record)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


async def read_json(request: Request) -> dict[str, Any] | JSONResponse:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        return error(400, f"JSON decode error: {e}")
    if not isinstance(body, dict):
        return error(400, "Input should be a valid dictionary or object to extract fields from")
    return body


def prefill_params(body: dict[str, Any], request_id: str) -> dict[str, Any] | None:
    """vLLM NixlConnector's answer to a prefill leg; None for any other request."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "asgi-engine",
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


def make_generate(chat: bool, model: str) -> Any:
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        if body.get("model", model) != model:
            return error(404, f"The model `{body.get('model')}` does not exist.", "model")
        stream = body.get("stream") is True
        if body.get("stream_options") and not stream:
            return error(
                400,
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                "stream_options",
            )
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        ident = ("chatcmpl-" if chat else "cmpl-") + request_id
        tokens = ["Hello", " from", " asgi"]

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                key = "delta" if stream else "message"
                return {
                    "index": 0,
                    key: {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            return {"index": 0, "text": text, "finish_reason": finish}

        if not stream:
            answer: dict[str, Any] = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice("".join(tokens), "length")],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            }
            params = prefill_params(body, request_id)
            if params is not None:
                answer["kv_transfer_params"] = params
            return JSONResponse(answer)

        include_usage = isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage")
        )

        async def events() -> Any:
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            for i, text in enumerate(tokens):
                finish = "length" if i == len(tokens) - 1 else None
                chunk = {
                    "id": ident,
                    "object": chunk_kind,
                    "created": created,
                    "model": model,
                    "choices": [choice(text, finish)],
                }
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
                await asyncio.sleep(0)
            if include_usage:
                usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
                chunk = {"id": ident, "object": chunk_kind, "created": created, "model": model}
                chunk.update(choices=[], usage=usage)
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return generate


def build_app(recorder: Recorder, model: str, redirects: list[str] | None = None) -> Any:
    async def models(_: Request) -> Response:
        card = {"id": model, "object": "model", "created": 0, "owned_by": "asgi-engine"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def tokenize(request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        text = body.get("prompt") if isinstance(body.get("prompt"), str) else ""
        tokens = list(range(len(text.split())))
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        return JSONResponse({"prompt": " ".join("t" for _ in body.get("tokens") or [])})

    async def embeddings(request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        item = {"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}
        usage = {"prompt_tokens": 1, "total_tokens": 1}
        return JSONResponse({"object": "list", "data": [item], "model": model, "usage": usage})

    async def recorded(request: Request) -> Response:
        if request.method == "DELETE":
            recorder.requests.clear()
            return Response(status_code=204)
        return JSONResponse({"requests": recorder.requests})

    async def not_found(_: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        detail = exc.detail if isinstance(exc, HTTPException) else "Not Found"
        return JSONResponse({"detail": detail}, status_code=status)

    async def redirect(request: Request) -> Response:
        # As an engine behind a proxy would: the Location names the address the request came to.
        return RedirectResponse(str(request.url.replace(path=request.url.path + "/")), 307)

    routes = [Route(path, redirect, methods=["GET", "POST"]) for path in redirects or []]
    routes += [
        Route("/v1/completions", make_generate(False, model), methods=["POST"]),
        Route("/v1/chat/completions", make_generate(True, model), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route(RECORD_PATH, recorded, methods=["GET", "DELETE"]),
    ]
    # Starlette's default: redirect_slashes=True, the 307 that vLLM (FastAPI) gives as well.
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    return Recording(app, recorder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: the kernel picks a free port")
    parser.add_argument("--record", help="append one JSON line per request to this file")
    parser.add_argument("--model", default="asgi-model")
    parser.add_argument(
        "--redirect",
        action="append",
        default=[],
        metavar="PATH",
        help="answer PATH with a 307 to PATH/ at the request's own address (repeatable)",
    )
    parser.add_argument(
        "--http", default="httptools", choices=["httptools", "h11"], help="uvicorn's HTTP parser"
    )
    args = parser.parse_args(argv)

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    print(sock.getsockname()[1], flush=True)

    recorder = Recorder(args.record)
    config = uvicorn.Config(
        build_app(recorder, args.model, args.redirect),
        http=args.http,
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
