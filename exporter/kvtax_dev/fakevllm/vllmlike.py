"""The raw transport's vLLM: :class:`VllmLike`, the script a
:class:`~kvtax_dev.fakevllm.upstream.RawUpstream` answers with unless a test gives its own.

Its events are the builder's (:mod:`kvtax_dev.fakevllm.events`, in the
:data:`~kvtax_dev.fakevllm.events.RAW` style: each token ``t``, no token id fields, no role
chunk); this module frames them as uvicorn does (chunked) and groups them into writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvtax_dev.fakevllm.events import RAW, Ask, dump, stream, whole
from kvtax_dev.fakevllm.raw import LAST_CHUNK, Link, Seen, chunk, echo, response_bytes, stream_head

__all__ = ["VllmLike"]

_JSON = [("Content-Type", "application/json")]


@dataclass
class VllmLike:
    """A script that answers the way vLLM does, from the request itself.

    ``/v1/completions`` and ``/v1/chat/completions``: a stream (chunked SSE, ``tokens`` per
    choice, usage per ``stream_options`` as vLLM sends it: per choice and cumulative with
    ``continuous_usage_stats``, a usage-only chunk with ``include_usage``,
    ``system_fingerprint`` on terminal chunks only when no usage chunk follows), or a whole
    completion with its usage. ``/v1/models`` lists ``m``. Any other path: an echo of what came
    (method, target, body length and sha256) as JSON. ``filler`` pads each token's text;
    ``per_write`` events go in one write; ``delay`` seconds between writes.
    """

    tokens: int = 5
    filler: int = 0
    per_write: int = 1
    delay: float = 0.0
    prompt_tokens: int = 3
    # Called with the link after each write of a stream: a test's hook to pause vLLM.
    after_write: Callable[[int], Awaitable[None]] | None = None

    async def __call__(self, seen: Seen, link: Link) -> None:
        await seen.complete.wait()
        path = seen.path
        if path in (b"/v1/completions", b"/v1/chat/completions") and seen.method == b"POST":
            await self._completion(seen, link, chat=path.endswith(b"chat/completions"))
        elif path == b"/v1/models":
            body = dump({"object": "list", "data": [{"id": "m", "object": "model"}]})
            await link.send(response_bytes(200, _JSON, body))
        else:
            await link.send(echo(seen))

    async def _completion(self, seen: Seen, link: Link, *, chat: bool) -> None:
        try:
            payload = seen.json()
        except ValueError:
            body = dump({"error": {"message": "invalid JSON", "type": "BadRequestError"}})
            await link.send(response_bytes(400, _JSON, body))
            return
        options = payload.get("stream_options") or {}
        include = bool(options.get("include_usage"))
        ask = Ask(
            chat=chat,
            model=payload.get("model") or "m",
            tokens=self.tokens,
            choices=int(payload.get("n") or 1),
            prompt=self.prompt_tokens,
            filler=self.filler,
            include=include,
            continuous=include and bool(options.get("continuous_usage_stats")),
        )
        if not payload.get("stream"):
            body = dump(whole(RAW, ask, "x" * self.tokens))
            await link.send(response_bytes(200, _JSON, body))
            return
        await link.send(stream_head())
        pending: list[bytes] = []
        writes_done = 0

        async def flush() -> None:
            nonlocal writes_done
            if pending:
                await link.send(chunk(b"".join(pending)))
                pending.clear()
                writes_done += 1
                if self.after_write is not None:
                    await self.after_write(writes_done)
                if self.delay:
                    await asyncio.sleep(self.delay)

        for event in stream(RAW, ask):
            pending.append(event.data)
            # The usage chunk and [DONE] go with the last write.
            if event.kind == "token" and len(pending) >= self.per_write:
                await flush()
        await flush()
        await link.send(LAST_CHUNK)
