"""No credential reaches a log: malformed requests on both ports, with kvtax's logging setup.

aiohttp's server (the web port) logs a request it cannot parse at ERROR, with an exception whose
text quotes the offending bytes; the proxy port's own parser refuses such a request and logs only
the peer. These tests send such bytes over a raw socket to a real web port and a real proxy port,
capture every record (formatted with its traceback), and look for the secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web

from kvtax import cli
from kvtax.serve import logsafe, wiring
from kvtax.serve.config import Config, load_config
from kvtax.serve.wiring import build

SECRET = b"SECRET-c0ffee-4711"

MALFORMED = {
    "control character in a header": b"GET /metrics HTTP/1.1\r\nHost: kvtax\r\n"
    b"Authorization: Bearer " + SECRET + b"\x01\r\n\r\n",
    "header over 8 KiB": b"GET /metrics HTTP/1.1\r\nHost: kvtax\r\n"
    b"Authorization: Bearer " + SECRET + b"A" * 9000 + b"\r\n\r\n",
    "request line over 8 KiB": b"GET /v1/models?api_key="
    + SECRET
    + b"A" * 9000
    + b" HTTP/1.1\r\nHost: kvtax\r\n\r\n",
    "bad chunk framing in a body": b"POST /v1/completions HTTP/1.1\r\nHost: kvtax\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + SECRET + b"\r\n",
    "not HTTP at all": SECRET + b" / HTTP/1.1\r\n\r\n",
}


@pytest.fixture
def safe_logging() -> Iterator[None]:
    logsafe.install()
    yield
    for name in logsafe.AIOHTTP_LOGGERS:
        logger = logging.getLogger(name)
        for found in [f for f in logger.filters if isinstance(f, logsafe.BadRequestFilter)]:
            logger.removeFilter(found)


@pytest.fixture
async def servers(aiohttp_server: Any) -> AsyncIterator[dict[str, tuple[str, int]]]:
    config = load_config({"proxy.listen_address": "off"}, env={}, file=None)
    delivery = build(config)
    web_port = await aiohttp_server(delivery.web.app())
    proxy_port = await delivery.proxy.start("127.0.0.1", 0)
    yield {"web port": (web_port.host, web_port.port), "proxy port": ("127.0.0.1", proxy_port)}
    await delivery.proxy.stop()


async def _send(server: tuple[str, int], raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*server)
    writer.write(raw)
    await writer.drain()
    # aiohttp logs the error before it answers and closes, so the record exists once EOF comes.
    response = await reader.read()
    writer.close()
    return response


def _everything_logged(records: list[logging.LogRecord]) -> str:
    formatter = logging.Formatter("%(levelname)s %(name)s %(message)s")
    return "\n".join(formatter.format(r) + repr(r.__dict__) for r in records)


@pytest.mark.parametrize("case", MALFORMED)
async def test_a_malformed_request_logs_no_credential_on_either_port(
    servers: dict[str, tuple[str, int]],
    caplog: pytest.LogCaptureFixture,
    safe_logging: None,
    case: str,
) -> None:
    for port, server in servers.items():
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            response = await _send(server, MALFORMED[case])
        assert response.split(b" ", 2)[1] == b"400", port
        logged = _everything_logged(caplog.records)
        assert SECRET.decode() not in logged, port
        assert "bad request from 127.0.0.1" in logged, port


async def test_other_errors_keep_their_traceback(
    aiohttp_server: Any, caplog: pytest.LogCaptureFixture, safe_logging: None
) -> None:
    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a bug in kvtax")

    app = web.Application()
    app.router.add_get("/", broken)
    server = await aiohttp_server(app)
    with caplog.at_level(logging.ERROR):
        response = await _send(
            (server.host, server.port),
            b"GET / HTTP/1.1\r\nHost: kvtax\r\nConnection: close\r\n\r\n",
        )
    assert response.startswith(b"HTTP/1.1 500")
    assert "RuntimeError: a bug in kvtax" in caplog.text


async def _no_serving(config: Config) -> int:
    return 0


def test_serve_installs_the_filter(monkeypatch: pytest.MonkeyPatch, safe_logging: None) -> None:
    server_logger = logging.getLogger("aiohttp.server")
    for found in list(server_logger.filters):
        server_logger.removeFilter(found)
    monkeypatch.setattr(wiring, "run", _no_serving)
    assert cli.main(["serve"]) == 0
    assert any(isinstance(f, logsafe.BadRequestFilter) for f in server_logger.filters)


def test_redact_url_drops_what_can_carry_credentials() -> None:
    url = "https://user:pw@gateway.example:4000/metrics?key=k#frag"
    assert logsafe.redact_url(url) == "https://gateway.example:4000/metrics"
    assert logsafe.redact_url("http://[::1]:9/m") == "http://[::1]:9/m"
    assert logsafe.redact_url("http://h:port/") == "(a malformed URL)"
