"""The OpenAI-compatible HTTP API: routes, the API key, errors, and the server thread.

    POST /v1/chat/completions   POST /v1/completions    (JSON, or server-sent events)
    GET  /v1/models             GET  /v1/models/{id}
    GET  /health                200 while serving, 503 while starting or draining
    GET  /metrics               Prometheus text (memspec.serving.prometheus)
    POST /tokenize              POST /detokenize        (llama-server's: text <-> a target's token ids)
    POST /api/chat              POST /api/generate      (Ollama's: NDJSON streams, or whole)
    GET  /api/tags   GET /api/ps   POST /api/show   GET /api/version   POST /api/pull

It runs inside the daemon (uvicorn on its own thread and event loop; Starlette
routes) and generates through the same Service as gRPC, so admission, limits,
queue, drain, counters and request logs are shared.  Each generation runs on a
thread of its own (`Pump`: the engine is blocking NumPy and ONNX Runtime work)
and hands its chunks to the event loop.  A client that disconnects sets the
request's cancel event at once: a queued request leaves the queue, a running one
stops at its next step, and its KV cache is freed.  Wire types are in
memspec.serving.openai and memspec.serving.ollama; every error leaves through `_error`, in
the shape of the API it answers ({"error": {...}} for /v1, {"error": "..."} for /api).
[http] cors_origins lets browser front ends on those origins call the API (off by default).

A request for n choices (OpenAI's `n`) runs as n requests of the Service, each on
its own Pump and all at once (`Choices`), so that admission counts n and the
engine's batch loop puts them in the same target passes; one cancel event ends
them all, and the first to fail fails the answer.  n is at most [server]
max_concurrent, the requests that may generate at once.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from collections import deque
from typing import Any, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from memspec import __version__
from memspec.config import HttpConfig
from memspec.errors import (
    AuthError, CancelledError, ConfigError, DeadlineExceededError, InvalidRequestError, MemspecError,
    ModelNotFoundError, RequestTooLargeError,
)
from memspec.models.tools import CallStream, parse_calls
from memspec.request import quote
from memspec.serving import ollama, openai, prometheus
from memspec.serving.address import LOOPBACK_HOSTS
from memspec.serving.service import Final, Service

log = logging.getLogger("memspec.http")
JSON_TYPES = ("application/json",)


# -- where it listens ----------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpAddress:
    host: str
    port: int  # 0: any free port (tests)

    @property
    def is_loopback(self) -> bool:
        if self.host in LOOPBACK_HOSTS:
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen(listen: str) -> HttpAddress:
    """"HOST:PORT", "[v6]:PORT", ":PORT" or "PORT" (the last two: loopback)."""
    host, _, port = listen.strip().rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"[http] listen {listen!r}: expected HOST:PORT, :PORT or PORT (0..65535)")
    return HttpAddress(host.strip("[]") or "127.0.0.1", int(port))


def check_exposure(address: HttpAddress, config: HttpConfig) -> None:
    """Beyond loopback the API needs a key, or allow_unauthenticated (then a warning)."""
    if address.is_loopback or config.key():
        return
    if not config.allow_unauthenticated:
        raise ConfigError(f"[http] listen {address} is beyond loopback and no API key is set: set [http] api_key "
                          f"(or ${config.api_key_env}), or allow_unauthenticated = true to let anyone who can reach "
                          f"the port generate")
    log.warning("HTTP API listening beyond loopback without an API key", extra={"fields": {"listen": str(address)}})


def body_limit(limits) -> int:
    """The largest body any request may have: the [limits]' largest request, with room for JSON
    escapes (\\uXXXX: 6 bytes for a character protobuf carries in at most 4)."""
    return 2 * limits.request_bytes()


# -- one generation, off the event loop ------------------------------------------------------------
class Choices:
    """The generations of one request, one per choice (OpenAI's n; usually one): one cancel event,
    and one queue on which their Pumps' messages reach the loop as (choice, kind, value)."""

    def __init__(self, cancel: threading.Event, loop: asyncio.AbstractEventLoop):
        self.cancel, self.loop = cancel, loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def start(self, index: int, items: Iterator) -> "Pump":
        """Choice `index`'s generation, on a thread of its own; from any thread."""
        return Pump(self, index).start(items)

    def put(self, index: int, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, kind, value))
        except RuntimeError:  # the loop has closed (shutdown past the grace)
            pass

    async def get(self) -> tuple[int, str, Any]:
        return await self.queue.get()


class Pump:
    """Service.generate of one choice on a thread of its own (from start()); what it yields reaches
    the loop through its Choices' queue.

    Messages: ("item", Chunk | Final), ("progress", str: how the load of its target goes, for a
    stream), ("error", exception), ("end", None), and the client's ("gone", None)."""

    def __init__(self, choices: Choices, index: int):
        self.choices, self.index, self.cancel = choices, index, choices.cancel
        self.items: Iterator = iter(())

    def start(self, items: Iterator) -> "Pump":
        self.items = items
        threading.Thread(target=self._run, name="memspec-http", daemon=True).start()
        return self

    def put(self, kind: str, value: Any = None) -> None:
        self.choices.put(self.index, kind, value)

    def _run(self) -> None:
        try:
            for item in self.items:
                self.put("item", item)
                if self.cancel.is_set():  # the client left or the deadline passed: stop, free the KV cache
                    break
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the client
            self.put("error", exc)
            return
        finally:
            self.items.close()
        self.put("end")


# -- the application ----------------------------------------------------------------------------
class Api:
    """The routes over one Service."""

    def __init__(self, service: Service, config: HttpConfig, clock: Callable[[], float] = time.monotonic):
        self.service = service
        self.backend = service.backend
        self.config = config
        self.key = config.key()
        self.clock = clock
        self.created = int(time.time())
        self.metrics = prometheus.registry(service)
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  # Ollama's API (memspec.serving.ollama)
                  Route("/", self.root, methods=["GET"]),
                  Route("/api/chat", self.ollama_chat, methods=["POST"]),
                  Route("/api/generate", self.ollama_generate, methods=["POST"]),
                  Route("/api/tags", self.ollama_tags, methods=["GET"]),
                  Route("/api/ps", self.ollama_ps, methods=["GET"]),
                  Route("/api/show", self.ollama_show, methods=["POST"]),
                  Route("/api/version", self.ollama_version, methods=["GET"]),
                  Route("/api/pull", self.ollama_pull, methods=["POST"])]
        middleware = [Middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                                 allow_headers=["*"])] if config.cors_origins else []
        self.app = Starlette(routes=routes, middleware=middleware,
                             exception_handlers={HTTPException: self._http_error, Exception: self._internal})

    # -- errors ----------------------------------------------------------------------------
    @staticmethod
    def _error(exc: BaseException, headers: dict | None = None, wire=openai) -> JSONResponse:
        """The error response in the shape of `wire`'s API (memspec.serving.openai or .ollama)."""
        status, body = wire.error(exc)
        headers = dict(headers or {})
        if status == 429:
            headers["Retry-After"] = "1"
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(body, status, headers=headers)

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own 404 (no route) and 405 (wrong method), in OpenAI's shape (Ollama's under /api)."""
        if exc.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}; use {exc.headers.get('Allow', '')}"
        elif request.url.path.startswith("/api/"):
            msg = (f"no route {request.method} {quote(request.url.path)}; memspec serves Ollama's POST /api/chat, "
                   f"POST /api/generate, GET /api/tags, GET /api/ps, POST /api/show, GET /api/version and "
                   f"POST /api/pull (not embeddings, create, copy, push or delete)")
        else:
            msg = (f"no route {request.method} {quote(request.url.path)}; the API has POST /v1/chat/completions, "
                   f"POST /v1/completions, GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize")
        body = {"error": {"message": msg, "type": "invalid_request_error", "param": None,
                          "code": "method_not_allowed" if exc.status_code == 405 else "not_found"}}
        if request.url.path.startswith("/api/"):
            body = {"error": msg}
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    async def _internal(self, request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", extra={"fields": {"path": request.url.path}})
        return self._error(exc)

    def _authorize(self, request: Request) -> None:
        if not self.key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            raise AuthError("no API key: send the header \"Authorization: Bearer <key>\" (the key is the daemon's "
                            f"[http] api_key or ${self.config.api_key_env})")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.key.encode()):
            raise AuthError("the API key is wrong: send the daemon's key as \"Authorization: Bearer <key>\"")

    # -- small routes ------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        state = self.service.state
        return JSONResponse({"status": state}, 200 if state == "serving" else 503)

    async def prometheus(self, request: Request) -> Response:
        data = await asyncio.to_thread(prometheus.render, self.metrics)
        return Response(data, media_type=prometheus.CONTENT_TYPE)

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
            rows = await asyncio.to_thread(self.backend.models)
        except MemspecError as exc:
            return self._error(exc)
        return JSONResponse(openai.models(rows, self.created))

    async def model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        try:
            self._authorize(request)
            rows = [r for r in await asyncio.to_thread(self.backend.models) if r["name"] == name]
            if not rows or rows[0]["role"] != "target":
                raise ModelNotFoundError(f"model: {quote(name)} is not a target in the store; GET /v1/models "
                                         f"lists them")
        except MemspecError as exc:
            return self._error(exc)
        return JSONResponse(openai.model(rows[0], self.created))

    async def tokenize(self, request: Request) -> JSONResponse:
        return await self._tokens(request, lambda body: self._tokenize(openai.parse_tokenize(body, self._max_chars())))

    async def detokenize(self, request: Request) -> JSONResponse:
        return await self._tokens(request, lambda body: self._detokenize(*openai.parse_detokenize(body)))

    def _max_chars(self) -> int:
        limits = self.backend.config.limits
        return max(limits.max_prompt_chars, limits.max_chat_chars)

    def _tokenize(self, req: openai.TokenizeRequest) -> dict:
        return openai.tokenize(self.backend.tokenizer(req.model), req)

    def _detokenize(self, model: str | None, tokens: list[int]) -> dict:
        return openai.detokenize(self.backend.tokenizer(model), tokens)

    async def _json(self, request: Request, limit: int) -> Any:
        """The body, within `limit` bytes, read as JSON; a named error otherwise."""
        body = await self._body(request, limit)
        if body is None:
            raise RequestTooLargeError(f"body: larger than {limit} bytes")
        try:
            return json.loads(body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidRequestError(f"body: is not valid JSON ({exc})") from None

    async def _tokens(self, request: Request, answer: Callable[[Any], dict]) -> JSONResponse:
        """A /tokenize or /detokenize call: auth, the body as JSON within the request limit, then answer(body)."""
        limit = body_limit(self.backend.config.limits)
        try:
            self._authorize(request)
            return JSONResponse(await asyncio.to_thread(answer, await self._json(request, limit)))
        except ClientDisconnect:
            return Response(status_code=499)
        except MemspecError as exc:
            return self._error(exc)

    # -- generation ------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, openai.parse_chat, "POST /v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, openai.parse_completion, "POST /v1/completions")

    async def _body(self, request: Request, limit: int) -> bytes | None:
        """The body, or None once it is over the limit (the rest is not read)."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return None
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                return None
        return bytes(data)

    def _parse(self, request: Request, body: bytes | None, limit: int, parser,
               spawn: Callable[[openai.ApiRequest], None], json_type: bool = True) -> Callable:
        """What Service.generate calls to build the request (its first choice's; `spawn` starts the
        others): every refusal in it is counted and logged.  json_type: the body must say it is JSON
        (OpenAI's API; Ollama's reads the body as JSON whatever it says, as curl sends it bare)."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()

        def parse():
            self._authorize(request)
            if body is None:
                raise RequestTooLargeError(f"body: larger than {limit} bytes, which the daemon's [limits] allow for "
                                           f"any request; shorten the prompt or messages")
            if json_type and content_type not in JSON_TYPES:
                raise InvalidRequestError(f"Content-Type: {quote(content_type or '(none)', 48)}; send the body as "
                                          f"JSON with \"Content-Type: application/json\"")
            try:
                data = json.loads(body)
            except (UnicodeDecodeError, ValueError) as exc:
                raise InvalidRequestError(f"body: is not valid JSON ({exc})") from None
            api = parser(data, self.backend.config.limits.max_tokens)
            slots = self.service.admission.config.max_concurrent
            if api.n > slots:
                raise InvalidRequestError(f"n: {api.n} choices asked for; at most {slots}: the choices generate at "
                                          f"once, a request each, and the daemon generates at most {slots} at once "
                                          f"([server] max_concurrent)")
            if api.ignored:
                log.debug("ignored unknown fields", extra={"fields": {"path": request.url.path,
                                                                      "fields": list(api.ignored)}})
            parsed.append(api)
            spawn(api)
            return api.choice(0)

        parsed: list[openai.ApiRequest] = []
        parse.parsed = parsed
        return parse

    async def _generate(self, request: Request, parser, method: str, wire=openai, reply=None,
                        body: bytes | None | bool = False) -> Response:
        """One generation request: its body (unless read already: `body`) parsed by `parser`, run,
        and answered by `reply` (a Reply class: OpenAI's by default), errors in `wire`'s shape."""
        limit = body_limit(self.backend.config.limits)
        arrived = time.monotonic()  # Ollama's total_duration counts from here
        if body is False:
            try:
                body = await self._body(request, limit)
            except ClientDisconnect:  # gone before its body arrived: nothing to answer
                return Response(status_code=499)
        client = request.client
        fields = {"method": method, "peer": f"{client.host}:{client.port}" if client else ""}
        cancel = threading.Event()
        timeout = self.config.timeout_seconds
        deadline = self.clock() + timeout if timeout > 0 else None
        expired = threading.Event()
        loop = asyncio.get_running_loop()

        def remaining():
            return None if deadline is None else max(deadline - self.clock(), 0.0)

        choices = Choices(cancel, loop)

        def spawn(api: openai.ApiRequest) -> None:  # choices 1..n-1 start as soon as choice 0 is parsed
            if api.n > 1:
                fields.update(n=api.n, choice=0)
            for i in range(1, api.n):
                own = {"method": method, "peer": fields["peer"], "n": api.n, "choice": i}  # a log line each
                choices.start(i, self.service.generate(lambda req=api.choice(i): req, cancel, remaining, own))

        parse = self._parse(request, body, limit, parser, spawn, json_type=wire is openai)

        def progress(message: str) -> None:  # a stream hears how the load of its target goes (SSE comments)
            if parse.parsed and parse.parsed[0].stream:
                choices.put(0, "progress", message)

        choices.start(0, self.service.generate(parse, cancel, remaining, fields, progress))
        timer = loop.call_later(timeout, lambda: (expired.set(), cancel.set())) if deadline else None
        watcher = asyncio.ensure_future(_watch(request.receive, choices))
        first, started = [], set()  # what came before the answer starts; the choices that have yielded
        try:
            while True:  # until every choice has begun (or a stream's target loads first: answer 200 now)
                index, kind, value = await choices.get()
                if kind in ("item", "end", "progress"):
                    first.append((index, kind, value))
                    started.add(index)
                    if kind == "progress" or len(started) == parse.parsed[0].n:
                        break
                else:  # an error (the first choice to fail fails them all) or the client is gone
                    cancel.set()
                    _stop(timer, watcher)
                    return (self._error(_deadline(value, expired), wire=wire) if kind == "error"
                            else Response(status_code=499))
        except BaseException:
            cancel.set()
            _stop(timer, watcher)
            raise
        api = parse.parsed[0]
        run = (reply or Reply)(api, choices, first, fields, expired, lambda: _stop(timer, watcher), arrived)
        if api.stream:
            return run
        try:
            return await run.whole()
        finally:
            run.done()


    # -- Ollama's API ------------------------------------------------------------------------------
    async def root(self, request: Request) -> Response:
        """GET / (and HEAD): what Ollama's clients probe to see that a server runs."""
        return PlainTextResponse("memspec is running (Ollama's API under /api, OpenAI's under /v1)")

    async def ollama_chat(self, request: Request) -> Response:
        return await self._ollama(request, ollama.parse_chat, "POST /api/chat", "chat")

    async def ollama_generate(self, request: Request) -> Response:
        return await self._ollama(request, ollama.parse_generate, "POST /api/generate", "generate")

    def _names(self) -> set[str]:
        return {r["name"] for r in self.backend.models()}

    async def _ollama(self, request: Request, parse, method: str, kind: str) -> Response:
        """/api/chat or /api/generate: a generation, or (no messages, no prompt) a load or an unload."""
        limit = body_limit(self.backend.config.limits)
        try:
            body = await self._body(request, limit)
        except ClientDisconnect:
            return Response(status_code=499)

        def parser(data, max_tokens):
            return parse(data, max_tokens, self._names())

        try:
            data = json.loads(body) if body is not None else None
        except (UnicodeDecodeError, ValueError):
            data = None  # refused, and counted, as a generation's bad body
        if ollama.load_only(kind, data):
            return await self._ollama_load(request, data, parser)
        return await self._generate(request, parser, method, wire=ollama, reply=OllamaReply, body=body)

    async def _ollama_load(self, request: Request, data: dict, parser) -> Response:
        """Ollama's request with no prompt: load its model (keep_alive 0: unload it) and say so."""
        t0 = self.clock()
        try:
            self._authorize(request)
            req = await asyncio.to_thread(parser, data, self.backend.config.limits.max_tokens)
            timeout = self.config.timeout_seconds or None
            await asyncio.to_thread(self.backend.warm, req.request.model, req.request.keep_alive, timeout)
        except MemspecError as exc:
            return self._error(exc, wire=ollama)
        answer = ollama.loaded(req, ollama.unloads(req), self.clock() - t0)
        if req.stream:
            return Response(_ndjson(answer), media_type=NDJSON)
        return JSONResponse(answer)

    async def _ollama_call(self, request: Request, answer: Callable[[Any], Any], body: bool = False) -> Response:
        """A small /api route: the key, the body as JSON when it has one, then answer(body) on a thread."""
        limit = body_limit(self.backend.config.limits)
        try:
            self._authorize(request)
            data = await self._json(request, limit) if body else None
            out = await asyncio.to_thread(answer, data)
        except ClientDisconnect:
            return Response(status_code=499)
        except MemspecError as exc:
            return self._error(exc, wire=ollama)
        return out if isinstance(out, Response) else JSONResponse(out)

    async def ollama_tags(self, request: Request) -> Response:
        return await self._ollama_call(request, lambda _: ollama.tags(self.backend.models()))

    async def ollama_ps(self, request: Request) -> Response:
        def answer(_):
            st = self.backend.status()
            return ollama.ps(self.backend.models(), st.targets, st.resident)

        return await self._ollama_call(request, answer)

    async def ollama_show(self, request: Request) -> Response:
        def answer(data):
            rows = self.backend.models()
            given, name = ollama.parse_model(data, {r["name"] for r in rows})
            row = next((r for r in rows if r["name"] == name and r["role"] == "target"), None)
            if row is None:
                raise ModelNotFoundError(f"model: {quote(given)} is not a target in the store; GET /api/tags lists "
                                         f"them")
            return ollama.show(row, self.backend.tokenizer(name).chat_template)

        return await self._ollama_call(request, answer, body=True)

    async def ollama_version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def ollama_pull(self, request: Request) -> Response:
        """The store's model at once; a catalogued one is pulled (the progress as status lines)."""
        from memspec.models.catalog import KNOWN_DRAFTS, KNOWN_MODELS

        loop = asyncio.get_running_loop()

        def answer(data):
            stream = data.get("stream", True) if isinstance(data, dict) else True
            known = {r["name"] for r in self.backend.models()}
            given, name = ollama.parse_model(data, known | set(KNOWN_MODELS) | set(KNOWN_DRAFTS))
            if name in known:
                return _pulled(stream, [])
            if name not in KNOWN_MODELS and name not in KNOWN_DRAFTS:
                raise ModelNotFoundError(f"model: {quote(given)} is neither in the store nor one memspec knows how to "
                                         f"pull; known: {', '.join((*KNOWN_MODELS, *KNOWN_DRAFTS))}")
            if not stream:
                self.backend.pull(name, lambda msg: None)
                return _pulled(False, [])
            return StreamingResponse(_pull_lines(loop, lambda say: self.backend.pull(name, say)), media_type=NDJSON)

        return await self._ollama_call(request, answer, body=True)


NDJSON = "application/x-ndjson"


def _ndjson(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _pulled(stream: bool, lines: list[str]) -> Response:
    if not stream:
        return JSONResponse({"status": "success"})
    return Response(b"".join(_ndjson({"status": s}) for s in [*lines, "success"]), media_type=NDJSON)


async def _pull_lines(loop: asyncio.AbstractEventLoop, run: Callable[[Callable[[str], None]], Any]):
    """`run(say)` on a thread; each line it says as {"status": ...}, then success or {"error": ...}."""
    queue: asyncio.Queue = asyncio.Queue()

    def work():
        try:
            run(lambda msg: loop.call_soon_threadsafe(queue.put_nowait, ("status", msg)))
            loop.call_soon_threadsafe(queue.put_nowait, ("status", "success"))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the client
            loop.call_soon_threadsafe(queue.put_nowait, ("error", ollama.error(exc)[1]["error"]))
        loop.call_soon_threadsafe(queue.put_nowait, ("end", None))

    threading.Thread(target=work, name="memspec-pull", daemon=True).start()
    while True:
        kind, value = await queue.get()
        if kind == "end":
            return
        yield _ndjson({kind: value})


def _deadline(exc: BaseException, expired: threading.Event) -> BaseException:
    """A request cancelled because its deadline passed is a deadline error (504), whichever of the
    timer and the queue's own deadline check saw it first."""
    if expired.is_set() and isinstance(exc, CancelledError):
        return DeadlineExceededError("the request's deadline passed ([http] timeout_seconds) before it finished")
    return exc


def _stop(timer, watcher) -> None:
    if timer is not None:
        timer.cancel()
    watcher.cancel()


async def _watch(receive, choices: Choices) -> None:
    """Wait for the client to go away; then cancel its generations at once."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            choices.cancel.set()
            choices.put(0, "gone")
            return


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class Progress(str):
    """How the load of a stream's target goes ("loading NAME (VARIANT): 4 s"): an SSE comment, which
    clients ignore and a person watching the stream reads (as Ollama shows a load)."""

    def sse(self) -> bytes:
        return b": " + " ".join(self.splitlines()).encode() + b"\n\n"


class Reply:
    """One request's answer, all its choices: whole (JSON), or streamed (an ASGI response of
    server-sent events, the choices' chunks interleaved as they come, each carrying its index)."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, api: openai.ApiRequest, choices: Choices, first: list, fields: dict,
                 expired: threading.Event, done: Callable, arrived: float = 0.0):
        self.api, self.choices, self.first, self.expired, self.done = api, choices, first, expired, done
        self.arrived = arrived  # when the request came in (the Api's clock)
        self.fields = fields  # the request's (choice 0's) log line: "model" is set once it runs
        self.id = ("chatcmpl-" if api.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def items(self):
        """(choice, Chunk | Final | Progress) as they come, until every choice has ended; raises what
        ended one early."""
        pending, ended = deque(self.first), 0
        while ended < self.api.n:
            index, kind, value = pending.popleft() if pending else await self.choices.get()
            if kind == "item":
                yield index, value
            elif kind == "progress":
                yield index, Progress(value)
            elif kind == "error":
                raise value
            elif kind == "end":  # after its Final
                ended += 1
            else:  # "gone"
                return

    def _ended_early(self) -> BaseException:
        return _deadline(CancelledError("the client went away"), self.expired)

    def _logprobs(self, chunk) -> list | None:
        return openai.logprob_entries(chunk.logprobs or []) if self.api.logprobs is not None else None

    async def whole(self) -> Response:
        n = self.api.n
        texts, finals = [[] for _ in range(n)], [None] * n
        logprobs = [[] if self.api.logprobs is not None else None for _ in range(n)]
        try:
            async for index, item in self.items():
                if isinstance(item, Final):
                    finals[index] = item
                elif not isinstance(item, Progress):
                    texts[index].append(item.text)
                    if logprobs[index] is not None:
                        logprobs[index] += self._logprobs(item)
        except Exception as exc:  # noqa: BLE001
            self.choices.cancel.set()  # one choice failed: the others end too
            return Api._error(_deadline(exc, self.expired))
        if any(f is None or f.completion.finish_reason == "cancelled" for f in finals):
            self.choices.cancel.set()
            return Api._error(self._ended_early())
        return JSONResponse(openai.response(self.api, self.id, self.created, finals, ["".join(t) for t in texts],
                                            logprobs))

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
        try:
            async for data in self._events():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.choices.cancel.set()  # the client left (or the server stops): generations still running end
            self.done()

    async def _events(self):
        api, model, n = self.api, self.fields.get("model", ""), self.api.n
        calls = [CallStream(api.tool_names) if api.tools else None for _ in range(n)]  # a call's text is held whole
        finals = [None] * n
        try:
            if api.kind == "chat":
                for i in range(n):
                    yield _sse(openai.chunk(api, self.id, self.created, model, None, role=True, index=i))
            async for index, item in self.items():
                if isinstance(item, Progress):
                    yield item.sse()
                    continue
                if isinstance(item, Final):
                    c = item.completion
                    if c.finish_reason == "cancelled":
                        raise self._ended_early()
                    finish = openai.finish_reason(c)
                    if calls[index] is not None:
                        for data in self._split(calls[index], index, None, model):
                            yield data
                        finish = openai.TOOL_CALLS if calls[index].calls else finish
                    yield _sse(openai.chunk(api, self.id, self.created, item.model, None, finish=finish, index=index))
                    finals[index] = item
                    if all(finals):
                        if api.include_usage:
                            yield _sse(openai.usage_chunk(api, self.id, self.created, finals))
                        break
                elif calls[index] is not None:
                    for data in self._split(calls[index], index, item, model):
                        yield data
                elif item.text or item.logprobs:
                    yield _sse(openai.chunk(api, self.id, self.created, model, item.text, self._logprobs(item),
                                            index=index))
        except Exception as exc:  # noqa: BLE001 - after the 200, an error is an event
            self.choices.cancel.set()  # one choice failed: the others end too
            yield _sse(openai.error(_deadline(exc, self.expired))[1])
        yield b"data: [DONE]\n\n"

    def _split(self, calls: CallStream, index: int, item, model: str) -> Iterator[bytes]:
        """A chunk of choice `index`'s answer that may call tools (None: its end, what was held
        back): its content (and logprobs), then each call it completes."""
        pieces = calls.feed(item.text) if item is not None else calls.finish()  # None: the answer's end
        text = "".join(p for p in pieces if isinstance(p, str))
        if text or (item is not None and item.logprobs):
            logprobs = self._logprobs(item) if item is not None else None
            yield _sse(openai.chunk(self.api, self.id, self.created, model, text, logprobs, index=index))
        found = [p for p in pieces if not isinstance(p, str)]
        for k, call in enumerate(found, start=calls.calls - len(found)):  # calls: found so far, these too
            for c in openai.tool_call_chunks(self.api, self.id, self.created, model, k, call, index):
                yield _sse(c)


class OllamaReply(Reply):
    """An Ollama answer (memspec.serving.ollama): whole, one JSON object; or streamed, NDJSON lines,
    the last with "done": true, its counts and durations.  Text that may be a tool call is held
    back until the call is whole (then it goes out as message.tool_calls)."""

    HEADERS = [(b"content-type", NDJSON.encode()), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

    def _final(self, item: Final, text: str, calls: list) -> dict:
        load_s = self.fields.get("check_ms", 0.0) / 1e3  # the wait for its target (memspec.serving.service)
        return ollama.final(self.api, item, time.monotonic() - self.arrived, load_s, text, calls)

    async def whole(self) -> Response:
        texts, final = [], None
        try:
            async for _, item in self.items():
                if isinstance(item, Final):
                    final = item
                elif not isinstance(item, Progress):
                    texts.append(item.text)
        except Exception as exc:  # noqa: BLE001
            self.choices.cancel.set()
            return Api._error(_deadline(exc, self.expired), wire=ollama)
        if final is None or final.completion.finish_reason == "cancelled":
            self.choices.cancel.set()
            return Api._error(self._ended_early(), wire=ollama)
        text = "".join(texts)
        content, calls = parse_calls(text, self.api.tool_names) if self.api.tools else (text, [])
        return JSONResponse(self._final(final, content, calls))

    async def _events(self):
        calls = CallStream(self.api.tool_names) if self.api.tools else None
        try:
            async for _, item in self.items():
                if isinstance(item, Progress):  # Ollama's stream is silent while its model loads
                    continue
                if isinstance(item, Final):
                    if item.completion.finish_reason == "cancelled":
                        raise self._ended_early()
                    pieces = calls.finish() if calls is not None else []  # what was held back
                    text = "".join(p for p in pieces if isinstance(p, str))
                    found = [p for p in pieces if not isinstance(p, str)]
                    if found:  # the answer was one bare call: it goes out before the last line
                        yield _ndjson(ollama.chunk(self.api, text, found))
                        text = ""
                    yield _ndjson(self._final(item, text, []))
                    return
                pieces = calls.feed(item.text) if calls is not None else [item.text]
                text = "".join(p for p in pieces if isinstance(p, str))
                found = [p for p in pieces if not isinstance(p, str)]
                if text or found:
                    yield _ndjson(ollama.chunk(self.api, text, found))
        except Exception as exc:  # noqa: BLE001 - after the 200, an error is a line
            self.choices.cancel.set()
            yield _ndjson(ollama.error(_deadline(exc, self.expired))[1])


# -- the server thread ------------------------------------------------------------------------------
class HttpServer:
    """uvicorn serving an Api on a socket bound at construction (so a taken port fails at start)."""

    def __init__(self, api: Api, address: HttpAddress, max_connections: int | None = None):
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart right after a kill
        try:
            self.sock.bind((address.host, address.port))
        except OSError as exc:
            self.sock.close()
            raise ConfigError(f"cannot listen on {address} for HTTP: {exc.strerror}") from None
        self.sock.listen(256)
        self.address = HttpAddress(address.host, self.sock.getsockname()[1])
        config = uvicorn.Config(api.app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, limit_concurrency=max_connections,
                                server_header=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="memspec-http-server", daemon=True)

    def start(self, timeout: float = 10.0) -> "HttpServer":
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > timeout:
                raise ConfigError(f"the HTTP server on {self.address} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listening socket and the connections (streams still open are cut)."""
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
