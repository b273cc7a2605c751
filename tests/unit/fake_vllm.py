"""An in-process stand-in for vLLM's OpenAI server, for proxy tests that need faults.

It streams the way vLLM 0.32 does: ``data: <json>\\n\\n`` events, cumulative usage on every chunk
only with ``continuous_usage_stats``, ``system_fingerprint`` on the terminal chunk only when no
usage chunk follows, then a usage-only chunk when ``include_usage`` was asked, then ``[DONE]``.
Knobs on :class:`FakeVllm` make it answer an error status (400, 500), hang before answering,
or stream slowly.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

FINGERPRINT = "vllm-0.32.0-fake1234"


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


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
        return web.json_response(
            {"object": "list", "data": [{"id": "m"}]}, headers={"X-Upstream": "yes"}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            return await self._answer(request)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.hang:
            await asyncio.sleep(self.hang)
        if self.status != 200:
            kind = "BadRequestError" if self.status < 500 else "InternalServerError"
            error = {"error": {"message": "boom", "type": kind, "code": self.status}}
            return web.json_response(error, status=self.status)
        prompt = 3
        if not body.get("stream"):
            usage = {"prompt_tokens": prompt, "total_tokens": prompt + self.tokens}
            usage["completion_tokens"] = self.tokens
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "text": "x" * self.tokens, "finish_reason": "length"}],
                    "usage": usage,
                }
            )
        options = body.get("stream_options") or {}
        include = bool(options.get("include_usage"))
        continuous = include and bool(options.get("continuous_usage_stats"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = 0
        while sent < self.tokens:
            if self.delay:
                await asyncio.sleep(self.delay)
            step = min(self.per_chunk, self.tokens - sent)
            sent += step
            finish = "length" if sent == self.tokens else None
            chunk: dict[str, Any] = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "text": 'ab"c}{' * step + "." * self.filler,
                        "finish_reason": finish,
                    }
                ],
            }
            if continuous:
                chunk["usage"] = {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt + sent,
                    "completion_tokens": sent,
                }
            if finish and not include:
                chunk["system_fingerprint"] = FINGERPRINT
            await response.write(b"data: " + _dump(chunk) + b"\n\n")
        if include:
            final = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt + sent,
                    "completion_tokens": sent,
                },
                "system_fingerprint": FINGERPRINT,
            }
            await response.write(b"data: " + _dump(final) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
