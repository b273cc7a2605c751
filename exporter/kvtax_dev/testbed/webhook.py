"""A webhook receiver for the alerting tests and the demo: it keeps what Alertmanager sends.

Each POST body is Alertmanager's webhook payload (``receiver``, ``status``, ``groupLabels``,
``alerts`` with ``labels`` and ``annotations``); it is kept with the request path, so a test
can give the pager and the ticket receivers different URLs and tell them apart.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from kvtax_dev.process import HANG_GUARD_S, poll_until

__all__ = ["Notification", "WebhookReceiver"]

Notification = tuple[str, dict[str, Any]]


class WebhookReceiver:
    """``with WebhookReceiver() as hook:`` then point receivers at ``hook.url + "/pager"``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received: list[Notification] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                with receiver._lock:
                    receiver._received.append((self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        # Port 0: the kernel picks a free one as it binds, so no other test can take it first.
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def received(self) -> list[Notification]:
        with self._lock:
            return list(self._received)

    def alerts(self, path: str | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Every alert received, as (path, alert), optionally only those sent to ``path``."""
        return [
            (p, alert)
            for p, body in self.received
            if path is None or p == path
            for alert in body.get("alerts", [])
        ]

    def wait_for(
        self,
        condition: Callable[[list[Notification]], bool],
        what: str,
        timeout: float = HANG_GUARD_S,
    ) -> list[Notification]:
        def met() -> tuple[list[Notification]] | None:
            received = self.received
            # In a tuple: a condition may well hold on an empty list, which is falsy.
            return (received,) if condition(received) else None

        found = poll_until(met, timeout=timeout)
        if found is None:
            raise AssertionError(f"webhook: {what} not received in {timeout}s; got {self.received}")
        return found[0]
