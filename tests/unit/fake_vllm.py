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
"""

from __future__ import annotations

import asyncio
import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

FINGERPRINT = "vllm-0.32.0-fake1234"
ROOT = "/models/fake"


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

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
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
        chat = request.path.endswith("/chat/completions")
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
