"""A tiny OpenAI-compatible server whose metrics page preempts above a chosen concurrency.

For the loadtest unit tests: every request that starts while more than ``fits`` are in flight
counts one preemption on its ``/metrics``, the way a KV pool that holds ``fits`` requests would.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import web

from kvtax_dev.fakevllm.events import DONE


@dataclass
class PreemptingServer:
    fits: int = 2
    token_delay: float = 0.002
    in_flight: int = 0
    preemptions: int = 0
    generated: int = 0
    prompt: int = 0
    requests: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.in_flight += 1
        self.requests += 1
        if self.in_flight > self.fits:
            self.preemptions += 1
        self.prompt += len(body["prompt"])
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(int(body["max_tokens"])):
                await asyncio.sleep(self.token_delay)
                self.generated += 1
                event = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(DONE)
            return resp
        finally:
            self.in_flight -= 1

    async def metrics(self, request: web.Request) -> web.Response:
        lab = '{engine="0",model_name="m"}'
        usage = min(1.0, self.in_flight / (self.fits + 1))
        page = (
            "# TYPE vllm:num_preemptions_total counter\n"
            f"vllm:num_preemptions_total{lab} {self.preemptions}\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total{lab} {self.generated}\n"
            "# TYPE vllm:prompt_tokens_total counter\n"
            f"vllm:prompt_tokens_total{lab} {self.prompt}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{lab} {usage}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{lab} {self.in_flight}\n"
        )
        return web.Response(text=page, content_type="text/plain")
