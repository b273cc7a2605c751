"""An in-process stand-in for vLLM's OpenAI server, for proxy tests that need faults.

It streams the way vLLM 0.32 does: ``data: <json>\\n\\n`` events, cumulative usage on every chunk
(per choice) only with ``continuous_usage_stats``, ``system_fingerprint`` on the terminal chunk
only when no usage chunk follows, then a usage-only chunk when ``include_usage`` was asked, then
``[DONE]``. It reads a request the way vLLM's request models do: a pydantic model in lax mode
(``"stream": "true"`` streams, ``"n": "2"`` is 2, ``"stream": "maybe"`` is a 400), with vLLM's
rule that ``stream_options`` needs a stream. ``n`` choices per prompt, a list of prompts, chat
shapes (``delta``, and tool calls for a request with ``tools``) as vLLM writes them.

Knobs on :class:`FakeVllm` make it answer an error status (400, 500; ``fail`` per prompt),
hang before answering, stream slowly, frame events with no space after ``data:`` (``tight``),
or gzip its answers (``gzip``: when the client accepts it; ``"always"``: whatever it asked).
``served`` makes it serve only those names, the first being its default and the name in every
answer (vLLM's ``--served-model-name``), 404 for any other; unset, it answers any model.

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
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

FINGERPRINT = "vllm-0.32.0-fake1234"
ROOT = "/models/fake"


def _speech(name: str) -> list[dict[str, Any]]:
    """The chunks of a stream vLLM's own generator wrote, with every usage option on."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "apis" / name
    events = path.read_bytes().split(b"\n\n")
    return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]


SPEECH = {
    "transcription": _speech("0.32-transcription.sse"),
    "translation": _speech("0.32-translation.sse"),
}


def _flag(value: str | None) -> bool:
    """A form's boolean as pydantic reads it (vLLM's request models)."""
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on", "t", "y")


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


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


# For a test of vLLM going silent mid-stream: the proxy's read timeout (STALL_TIMEOUT) is long
# enough that the head, written at once, beats it even on a machine whose load deschedules the
# test for seconds (4.1 s was seen at load average 10), and the fake's silence (STALL) is far
# longer. Serve the fake with handler_cancellation, so the silence ends when kvtax hangs up.
STALL_TIMEOUT = 5.0
STALL = 120.0


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

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
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
        choices = n * (1 if chat else len(prompts))
        prompt = 3 * (1 if chat else len(prompts))
        shape = _Shape(chat, bool(req.tools), model)
        if not req.stream:
            return self._whole(request, shape, choices, prompt)
        options = req.stream_options
        include = bool(options and options.include_usage)
        continuous = include and bool(options and options.continuous_usage_stats)
        headers = {"Content-Type": "text/event-stream"}
        packer = None
        if self._packs(request):
            headers["Content-Encoding"] = self.coding
            packer = zlib.compressobj(6, zlib.DEFLATED, 31)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        lead = b"data:" if self.tight else b"data: "

        wrote = [0]

        async def write(data: bytes, last: bool = False) -> None:
            if packer is not None:
                data = packer.compress(data) + packer.flush(
                    zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH
                )
                if self.corrupt and wrote[0]:
                    data = bytes(b ^ 0x5A for b in data)
                wrote[0] += 1
            if data:
                await response.write(data)

        ids = bool(req.return_token_ids) and not self.drop_ids
        if chat:
            # vLLM's chat stream opens with a role chunk per choice, which carries no ids; the
            # prompt's ids are at its top level (null unless asked for).
            for index in range(choices):
                role = shape.head()
                role["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""}}]
                role["prompt_token_ids"] = [11] * prompt if ids and index == 0 else None
                if continuous:
                    role["usage"] = {
                        "prompt_tokens": prompt,
                        "total_tokens": prompt,
                        "completion_tokens": 0,
                    }
                await write(lead + _dump(role) + b"\n\n")
        sent = [0] * choices
        while sum(sent) < self.tokens * choices:
            if self.delay:
                await asyncio.sleep(self.delay)
            for index in range(choices):
                step = min(self.per_chunk, self.tokens - sent[index])
                first = sent[index] == 0
                sent[index] += step
                finish = "length" if sent[index] == self.tokens else None
                chunk = shape.chunk(index, step, finish, self.filler)
                choice = chunk["choices"][0]
                if not chat:
                    # vLLM 0.32 writes both fields on every completions event, null unless
                    # asked for; the prompt's ids come with each choice's first event.
                    choice["prompt_token_ids"] = [11] * 3 if ids and first else None
                choice["token_ids"] = list(range(100, 100 + step)) if ids else None
                if continuous:
                    chunk["usage"] = {
                        "prompt_tokens": prompt,
                        "total_tokens": prompt + sent[index],
                        "completion_tokens": sent[index],
                    }
                if finish and not include:
                    chunk["system_fingerprint"] = FINGERPRINT
                await write(lead + _dump(chunk) + b"\n\n")
        if include:
            final = shape.head()
            final["choices"] = []
            final["usage"] = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + sum(sent),
                "completion_tokens": sum(sent),
            }
            final["system_fingerprint"] = FINGERPRINT
            await write(lead + _dump(final) + b"\n\n")
        await write(lead + b"[DONE]\n\n", last=True)
        await response.write_eof()
        return response

    # -- the other generation APIs ---------------------------------------------------------------
    async def _start(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The request's body, recorded; or the error answer that ends it."""
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
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
        conversations = body.get("messages") or []
        shape = _Shape(True, False, body.get("model") or "m")
        answer = shape.head(whole=True)
        answer["choices"] = [shape.whole(i, self.tokens) for i in range(len(conversations))]
        completion, prompt = self.tokens * len(conversations), 3 * len(conversations)
        answer["usage"] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        return web.Response(body=_dump(answer), headers={"Content-Type": "application/json"})

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
        usage: dict[str, Any] = {"input_tokens": prompt, "output_tokens": self.tokens}
        if not body.get("stream"):
            answer: dict[str, Any]
            if messages:
                text = {"type": "text", "text": "x" * self.tokens}
                answer = {"id": "msg-1", "type": "message", "role": "assistant"}
                answer |= {"content": [text], "model": model, "stop_reason": "max_tokens"}
            else:
                answer = {"id": "resp-1", "object": "response", "model": model, "output": []}
                answer["status"] = "completed"
            answer["usage"] = usage
            return web.Response(body=_dump(answer), headers={"Content-Type": "application/json"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sequence = [0]

        async def event(name: str, data: dict[str, Any]) -> None:
            if not messages:  # the Responses API numbers its events and names each in its data
                data = {**data, "sequence_number": sequence[0], "type": name}
                sequence[0] += 1
            await response.write(b"event: %b\ndata: %b\n\n" % (name.encode(), _dump(data)))

        start: dict[str, Any] = {"id": "msg-1", "model": model}
        if messages:
            start |= {"type": "message", "role": "assistant", "content": []}
            start["usage"] = {"input_tokens": prompt, "output_tokens": 0}
            await event("message_start", {"type": "message_start", "message": start})
            block = {"type": "text", "text": ""}
            opened = {"type": "content_block_start", "content_block": block, "index": 0}
            await event("content_block_start", opened)
        else:
            start |= {"status": "in_progress", "usage": None}
            await event("response.created", {"response": start})
            await event("response.in_progress", {"response": start})
        sent = events = 0
        while sent < self.tokens:
            if self.delay:
                await asyncio.sleep(self.delay)
            if events == self.pause_after:
                await asyncio.sleep(STALL)
            events += 1
            step = min(self.per_chunk, self.tokens - sent)
            sent += step
            piece = 'ab"c}{' * step
            data: dict[str, Any]
            if messages:
                data = {"type": "content_block_delta", "index": 0}
                data["delta"] = {"type": "text_delta", "text": piece}
                await event("content_block_delta", data)
            else:
                data = {"content_index": 0, "delta": piece, "item_id": "msg-1", "logprobs": []}
                await event("response.output_text.delta", data)
        if messages:
            await event("content_block_stop", {"type": "content_block_stop", "index": 0})
            ended: dict[str, Any] = {"type": "message_delta", "usage": usage}
            ended["delta"] = {"stop_reason": "max_tokens", "stop_sequence": None}
            await event("message_delta", ended)
            await event("message_stop", {"type": "message_stop"})
        else:
            await event("response.output_text.done", {"content_index": 0, "text": "x"})
            done: dict[str, Any] = {"id": "resp-1", "model": model, "status": "completed"}
            done["usage"] = {**usage, "total_tokens": prompt + sent}
            await event("response.completed", {"response": done})
        await response.write_eof()
        return response

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """/inference/v1/generate: token ids in every event, the final usage if asked."""
        body = await self._start(request)
        if isinstance(body, web.Response):
            return body
        params = body.get("sampling_params") or {}
        n, prompt = int(params.get("n") or 1), len(body.get("token_ids") or [])
        head: dict[str, Any] = {"request_id": "generate-tokens-1", "usage": None}
        if not body.get("stream"):
            completion = self.tokens * n
            answer: dict[str, Any] = {**head, "model": body.get("model") or "m"}
            answer["usage"] = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "completion_tokens": completion,
            }
            answer["choices"] = [
                {"index": i, "finish_reason": "length", "token_ids": [7] * self.tokens}
                for i in range(n)
            ]
            return web.Response(body=_dump(answer), headers={"Content-Type": "application/json"})
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
                choice: dict[str, Any] = {"index": index, "finish_reason": finish}
                choice |= {"stop_reason": None, "token_ids": list(range(100, 100 + step))}
                choice["logprobs"] = None
                chunk = {**head, "output_mode": "tokens", "choices": [choice]}
                await response.write(b"data: " + _dump(chunk) + b"\n\n")
        if options.get("include_usage"):
            total: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + sum(sent)}
            total["completion_tokens"] = sum(sent)
            final = {"request_id": head["request_id"], "usage": total, "output_mode": "tokens"}
            await response.write(b"data: " + _dump({**final, "choices": []}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
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
        self.requests.append(fields)
        self.headers.append(dict(request.headers))
        if self.status != 200:
            return self._error(self.status)
        stream = _flag(fields.get("stream"))
        include = _flag(fields.get("stream_include_usage"))
        continuous = include and _flag(fields.get("stream_continuous_usage_stats"))
        if not stream and (include or _flag(fields.get("stream_continuous_usage_stats"))):
            return self._error(400, "Stream options can only be defined when `stream=True`.")
        kind = "translation" if request.path.endswith("translations") else "transcription"
        chunks = SPEECH[kind]
        if not stream:
            text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
            answer = {"text": text, "usage": {"type": "duration", "seconds": 1}}
            return web.Response(body=_dump(answer), headers={"Content-Type": "application/json"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for count, chunk in enumerate(chunks):
            if count == self.pause_after:
                await asyncio.sleep(STALL)
            if not chunk["choices"] and not include:
                continue  # the final usage chunk, sent only when asked for
            sent = chunk
            if chunk["choices"] and not continuous:
                sent = {key: value for key, value in chunk.items() if key != "usage"}
            await response.write(b"data: " + _dump(sent) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _whole(
        self, request: web.Request, shape: _Shape, choices: int, prompt: int
    ) -> web.Response:
        completion = self.tokens * choices
        answer = shape.head(whole=True)
        answer["choices"] = [shape.whole(i, self.tokens) for i in range(choices)]
        answer["usage"] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        data = _dump(answer)
        headers = {"Content-Type": "application/json"}
        if self._packs(request):
            headers["Content-Encoding"] = self.coding
            data = _gzip(data)
        return web.Response(body=data, headers=headers)


@dataclass(frozen=True)
class _Shape:
    """The JSON of one answer: completions or chat, with tool calls or text."""

    chat: bool
    tools: bool
    model: str

    def head(self, *, whole: bool = False) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if self.chat and not whole:
            kind += ".chunk"
        return {"id": "cmpl-1", "object": kind, "created": 1, "model": self.model}

    def chunk(self, index: int, step: int, finish: str | None, filler: int) -> dict[str, Any]:
        text = 'ab"c}{' * step + "." * filler
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif self.tools:
            call = {"index": 0, "function": {"arguments": '{"usage":{' * step}}
            choice["delta"] = {"tool_calls": [call]}
        else:
            choice["delta"] = {"content": text}
        choice["finish_reason"] = finish
        chunk = self.head()
        chunk["choices"] = [choice]
        return chunk

    def whole(self, index: int, tokens: int) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": "x" * tokens, "finish_reason": "length"}
        message: dict[str, Any] = {"role": "assistant", "content": "x" * tokens}
        if self.tools:
            call = {
                "id": "call-1",
                "type": "function",
                "function": {"name": "f", "arguments": "{}"},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"index": index, "message": message, "finish_reason": "length"}


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
