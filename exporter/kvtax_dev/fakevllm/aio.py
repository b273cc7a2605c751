"""The aiohttp transport: :class:`FakeVllm`, the in-process vLLM of the unit tests that need faults.

It reads a request the way vLLM's request models do: a pydantic model in lax mode (``"stream":
"true"`` streams, ``"n": "2"`` is 2, ``"stream": "maybe"`` is a 400), with vLLM's rule that
``stream_options`` needs a stream; ``n`` choices per prompt, a list of prompts, chat shapes
(``delta``, and tool calls for a request with ``tools``). What it answers is built by
:mod:`kvtax_dev.fakevllm.events` in the :data:`~kvtax_dev.fakevllm.events.TESTS` style (each
token ``ab"c}{``) and :mod:`kvtax_dev.fakevllm.apis`; this module decides only when and how the
bytes go out.

Knobs on :class:`FakeVllm` make it answer an error status (400, 500; ``fail`` per prompt), hang
before answering, stream slowly, frame events with no space after ``data:`` (``tight``), or gzip
its answers (``gzip``: when the client accepts it; ``"always"``: whatever it asked). ``served``
makes it serve only those names, the first being its default and the name in every answer
(vLLM's ``--served-model-name``), 404 for any other; unset, it answers any model.

Beside completions and chat it serves vLLM 0.32's other generation APIs in their own bytes (as
captured from the real engine): Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses`` as
named events (usage at their end only; ``per_chunk`` tokens per content event), the token-in,
token-out ``/inference/v1/generate`` (ids in every event), ``/v1/chat/completions/batch`` (one
choice per conversation, never streamed) and SageMaker's ``/invocations`` (a chat or a
completions body). ``/v1/audio/transcriptions`` and ``/translations`` read the multipart form as
Starlette does for vLLM (the last of two fields of one name) and replay the stream vLLM's own
generator wrote (``tests/fixtures/vllm/apis/0.32-transcription.sse``: nine tokens, one of them
with no text and no chunk of its own), its usage kept as the form's options ask.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kvtax_dev import repo_root
from kvtax_dev.fakevllm import apis
from kvtax_dev.fakevllm.events import TESTS, Ask, done, dump, encode, stream, whole

__all__ = ["ROOT", "SPEECH", "STALL", "STALL_TIMEOUT", "FakeVllm", "listen", "serve"]

ROOT = "/models/fake"
_CAPTURES = repo_root() / "tests" / "fixtures" / "vllm" / "apis"
SPEECH = {
    kind: apis.speech_chunks((_CAPTURES / f"0.32-{kind}.sse").read_bytes())
    for kind in ("transcription", "translation")
}

# For a test of vLLM going silent mid-stream: the proxy's read timeout (STALL_TIMEOUT) is long
# enough that the head, written at once, beats it even on a machine whose load deschedules the
# test for seconds (4.1 s was seen at load average 10), and the fake's silence (STALL) is far
# longer. Serve the fake with handler_cancellation, so the silence ends when kvtax hangs up.
STALL_TIMEOUT = 5.0
STALL = 120.0


def _flag(value: str | None) -> bool:
    """A form's boolean as pydantic reads it (vLLM's request models)."""
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on", "t", "y")


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    """The fields of vLLM's CompletionRequest / ChatCompletionRequest this fake acts on."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    n: int | None = 1
    max_tokens: int | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_ids: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_a_stream(cls, data: Any) -> Any:
        # vLLM's own check, on the raw values.
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return data


def _gzip(data: bytes) -> bytes:
    """Deterministic gzip (no timestamp), so two answers compare byte for byte."""
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)
    return packer.compress(data) + packer.flush()


def _json(answer: dict[str, Any]) -> web.Response:
    return web.Response(body=dump(answer), headers={"Content-Type": "application/json"})


@dataclass
class FakeVllm:
    tokens: int = 5
    per_chunk: int = 1
    delay: float = 0.0
    status: int = 200
    hang: float = 0.0
    filler: int = 0
    active: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    served: tuple[str, ...] | None = None
    fail: dict[str, int] = field(default_factory=dict)
    tight: bool = False
    gzip: Literal["off", "on", "always"] = "off"
    # The Content-Encoding it names for those bytes: "br" makes them a coding kvtax cannot read.
    coding: str = "gzip"
    # Spoil the compressed stream's bytes after its first write (what zlib cannot read).
    corrupt: bool = False
    # Ignore return_token_ids, as a vLLM without the field would (its events carry none).
    drop_ids: bool = False
    # Go silent for STALL after this many content events of a named-event or generate stream
    # (a client's view of a stream it leaves: exactly these events reached it).
    pause_after: int | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024**2)  # uploads, as vLLM takes them
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/chat/completions/batch", self.batch)
        app.router.add_post("/invocations", self.completions)
        app.router.add_post("/v1/messages", self.named)
        app.router.add_post("/v1/responses", self.named)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/v1/audio/transcriptions", self.speech)
        app.router.add_post("/v1/audio/translations", self.speech)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        return app

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(
            body=body[::-1], status=201, headers={"X-Auth-Seen": request.headers["Authorization"]}
        )

    async def models(self, request: web.Request) -> web.Response:
        if self.served is None:
            data: list[dict[str, Any]] = [{"id": "m"}]
        else:  # as vLLM lists them: each served name, then adapters with their parent
            data = [
                {"id": name, "object": "model", "root": ROOT, "parent": None}
                for name in self.served
            ]
        return web.json_response({"object": "list", "data": data}, headers={"X-Upstream": "yes"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            return await self._answer(request)
        finally:
            self.active -= 1

    def _error(self, status: int, message: str = "boom") -> web.Response:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
        error = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return web.json_response(error, status=status)

    def _packs(self, request: web.Request) -> bool:
        if self.gzip == "always":
            return True
        # No Accept-Encoding at all means any coding is acceptable (RFC 9110 12.5.3).
        accepted = request.headers.get("Accept-Encoding", "gzip")
        return self.gzip == "on" and "gzip" in accepted

    def _record(self, request: web.Request, body: Any) -> None:
        self.requests.append(body)
        self.headers.append(dict(request.headers))

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record(request, body)
        if self.hang:
            await asyncio.sleep(self.hang)
        if self.status != 200:
            return self._error(self.status)
        try:
            req = _Request.model_validate(body)
        except ValidationError as exc:
            return self._error(400, f"validation: {exc.error_count()} error(s)")
        if self.served is None:
            model = req.model or "m"
        elif not req.model or req.model in self.served:
            model = self.served[0]  # vLLM answers with its first served name
        else:
            return self._error(404, f"The model `{req.model}` does not exist.")
        prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt or ""]
        for text in prompts:
            if text in self.fail:
                return self._error(self.fail[text])
        n = req.n if req.n is not None else 1
        if n < 1:
            return self._error(400, "n must be at least 1.")
        chat = request.path.endswith("/chat/completions") or (
            request.path == "/invocations" and isinstance(body.get("messages"), list)
        )
        options = req.stream_options
        include = bool(options and options.include_usage)
        ask = Ask(
            chat=chat,
            model=model,
            tokens=self.tokens,
            choices=n * (1 if chat else len(prompts)),
            prompts=1 if chat else len(prompts),
            per_chunk=self.per_chunk,
            filler=self.filler,
            tools=bool(req.tools),
            include=include,
            continuous=include and bool(options and options.continuous_usage_stats),
            ids=bool(req.return_token_ids) and not self.drop_ids,
        )
        if not req.stream:
            return self._whole(request, ask)
        return await self._stream(request, ask)

    async def _stream(self, request: web.Request, ask: Ask) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream"}
        packer = None
        if self._packs(request):
            headers["Content-Encoding"] = self.coding
            packer = zlib.compressobj(6, zlib.DEFLATED, 31)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        wrote = 0
        style = replace(TESTS, lead=b"data:") if self.tight else TESTS
        for event in stream(style, ask):
            # The delay paces rounds: one event per choice, then the pause.
            if self.delay and event.kind == "token" and event.index == 0:
                await asyncio.sleep(self.delay)
            data = event.data
            if packer is not None:
                last = event.kind == "done"
                data = packer.compress(data) + packer.flush(
                    zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH
                )
                if self.corrupt and wrote:
                    data = bytes(b ^ 0x5A for b in data)
                wrote += 1
            if data:
                await response.write(data)
        await response.write_eof()
        return response

    def _whole(self, request: web.Request, ask: Ask) -> web.Response:
        data = dump(whole(TESTS, ask, "x" * ask.tokens))
        headers = {"Content-Type": "application/json"}
        if self._packs(request):
            headers["Content-Encoding"] = self.coding
            data = _gzip(data)
        return web.Response(body=data, headers=headers)

    # -- the other generation APIs ---------------------------------------------------------------
    async def _start(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The request's body, recorded; or the error answer that ends it."""
        body = await request.json()
        self._record(request, body)
        if self.hang:
            await asyncio.sleep(self.hang)
        if self.status != 200:
            if request.path == "/v1/messages":  # vLLM translates its errors there
                error = {"type": "error", "error": {"type": "BadRequestError", "message": "x"}}
                return web.json_response(error, status=self.status)
            return self._error(self.status)
        if not isinstance(body, dict):
            return self._error(400, "not an object")
        return body

    async def batch(self, request: web.Request) -> web.StreamResponse:
        body = await self._start(request)
        if isinstance(body, web.Response):
            return body
        if body.get("stream"):
            return self._error(400, "Streaming is not supported for batch chat completions.")
        conversations = len(body.get("messages") or [])
        model = body.get("model") or "m"
        ask = Ask(
            chat=True, model=model, tokens=self.tokens, choices=conversations, prompts=conversations
        )
        return _json(whole(TESTS, ask, "x" * self.tokens))

    async def named(self, request: web.Request) -> web.StreamResponse:
        """/v1/messages or /v1/responses: named events, usage at the end only."""
        body = await self._start(request)
        if isinstance(body, web.Response):
            return body
        self.active += 1
        try:
            return await self._named(request, body, messages=request.path == "/v1/messages")
        finally:
            self.active -= 1

    async def _named(
        self, request: web.Request, body: dict[str, Any], *, messages: bool
    ) -> web.StreamResponse:
        model, prompt = body.get("model") or "m", 3
        if not body.get("stream"):
            return _json(self._named_whole(model, prompt, messages=messages))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        shape = apis.Named(messages, model, prompt)
        for event in shape.opening():
            await response.write(event)
        sequence, sent = shape.opened, 0
        while sent < self.tokens:
            if self.delay:
                await asyncio.sleep(self.delay)
            if sequence - shape.opened == self.pause_after:
                await asyncio.sleep(STALL)
            step = min(self.per_chunk, self.tokens - sent)
            sent += step
            await response.write(shape.delta(sequence, TESTS.piece * step))
            sequence += 1
        for event in shape.closing(sequence, sent):
            await response.write(event)
        await response.write_eof()
        return response

    def _named_whole(self, model: str, prompt: int, *, messages: bool) -> dict[str, Any]:
        answer: dict[str, Any]
        if messages:
            text = {"type": "text", "text": "x" * self.tokens}
            answer = {"id": "msg-1", "type": "message", "role": "assistant"}
            answer |= {"content": [text], "model": model, "stop_reason": "max_tokens"}
        else:
            answer = {"id": "resp-1", "object": "response", "model": model, "output": []}
            answer["status"] = "completed"
        answer["usage"] = {"input_tokens": prompt, "output_tokens": self.tokens}
        return answer

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """/inference/v1/generate: token ids in every event, the final usage if asked."""
        body = await self._start(request)
        if isinstance(body, web.Response):
            return body
        params = body.get("sampling_params") or {}
        n, prompt = int(params.get("n") or 1), len(body.get("token_ids") or [])
        if not body.get("stream"):
            model = body.get("model") or "m"
            return _json(apis.generate_whole(model, n, self.tokens, prompt))
        options = body.get("stream_options") or {}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = [0] * n
        events = 0
        while sum(sent) < self.tokens * n:
            if self.delay:
                await asyncio.sleep(self.delay)
            for index in range(n):
                if events == self.pause_after:
                    await asyncio.sleep(STALL)
                events += 1
                step = min(self.per_chunk, self.tokens - sent[index])
                sent[index] += step
                finish = "length" if sent[index] == self.tokens else None
                await response.write(encode(apis.generate_chunk(index, step, finish)))
        if options.get("include_usage"):
            await response.write(encode(apis.generate_usage(prompt, sum(sent))))
        await response.write(done())
        await response.write_eof()
        return response

    async def speech(self, request: web.Request) -> web.StreamResponse:
        """The audio APIs: the form read as vLLM's server reads it, the recorded stream."""
        form = await request.post()
        fields = {key: str(form.getall(key)[-1]) for key in form if key != "file"}
        upload = form.get("file")
        size = 0
        if isinstance(upload, web.FileField):
            with upload.file:
                size = len(upload.file.read())
        fields["file_bytes"] = str(size)
        self._record(request, fields)
        if self.status != 200:
            return self._error(self.status)
        streamed = _flag(fields.get("stream"))
        include = _flag(fields.get("stream_include_usage"))
        continuous = include and _flag(fields.get("stream_continuous_usage_stats"))
        if not streamed and (include or _flag(fields.get("stream_continuous_usage_stats"))):
            return self._error(400, "Stream options can only be defined when `stream=True`.")
        kind = "translation" if request.path.endswith("translations") else "transcription"
        chunks = SPEECH[kind]
        if not streamed:
            seconds = {"type": "duration", "seconds": 1}
            return _json({"text": apis.speech_text(chunks), "usage": seconds})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for count, chunk in enumerate(chunks):
            if count == self.pause_after:
                await asyncio.sleep(STALL)
            event = apis.speech_event(chunk, include=include, continuous=continuous)
            if event is not None:
                await response.write(event)
        await response.write(done())
        await response.write_eof()
        return response


async def listen(runner: web.AppRunner) -> str:
    """Set ``runner`` up on 127.0.0.1, on the port the kernel picks (port 0, so no test can race
    another for it); its base URL."""
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


async def serve(app: web.Application, **runner_kwargs: Any) -> tuple[web.AppRunner, str]:
    """Serve ``app`` as :func:`listen` does (``runner_kwargs`` go to its ``AppRunner``, such as
    ``handler_cancellation``); the runner, to clean up, and the base URL."""
    runner = web.AppRunner(app, access_log=None, **runner_kwargs)
    return runner, await listen(runner)
