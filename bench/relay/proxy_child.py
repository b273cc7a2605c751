"""kvtax's proxy alone in a process of its own, on a port the kernel picks, for measurements of
its memory that the measuring process must not disturb (``python -m bench.relay.proxy_child``).

It builds the proxy as ``kvtax serve`` does (its default settings, uvloop where installed) in
front of ``--upstream``, prints ``port <n>`` on a line of its own once it listens, and serves
until SIGTERM or SIGINT, then stops the proxy (``--grace`` seconds of drain). ``--healthz``
also answers ``/healthz`` on a second port, on the proxy's event loop as ``kvtax serve``'s web
port does, and prints ``healthz <n>`` after the first line: a probe of what the loop is free
for. ``--gate-budget`` puts the gate in front (a static cap, that token budget, clamping). Used
by ``tests/unit/test_front_door.py`` (the 20 MiB upload's RSS), ``tests/unit/
test_front_door_costly.py`` and :mod:`bench.relay.frontdoor`.

Example::

    python -m bench.relay.proxy_child --upstream=http://127.0.0.1:8000 --max-body=4194304
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TypedDict

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.gate.cap import CapSettings
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings

__all__ = ["main"]


class _Limits(TypedDict, total=False):
    """The ProxySettings fields given on the command line (the rest keep their defaults)."""

    max_body: int
    timeout: float


async def _serve(args: argparse.Namespace) -> None:
    names = ModelNames()
    names.update(["m"])
    settings: _Limits = {}
    if args.max_body is not None:
        settings["max_body"] = args.max_body
    if args.timeout is not None:
        settings["timeout"] = args.timeout
    gate = None
    if args.gate_budget is not None:
        cap = CapSettings(mode="static", static_cap=64)
        gate = Gate(GateSettings(cap=cap, token_budget=args.gate_budget, over_budget="clamp"))
    proxy = Proxy(
        ProxySettings(upstream=args.upstream, **settings), DeliveryLedger(names), gate=gate
    )
    port = await proxy.start("127.0.0.1", 0)
    print(f"port {port}", flush=True)
    if args.healthz:
        health = await asyncio.start_server(_healthz, "127.0.0.1", 0)
        print(f"healthz {health.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.stop(args.grace)


async def _healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """``200 ok`` to each request of a keep-alive connection (its head only is read)."""
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="vLLM's URL")
    parser.add_argument("--max-body", type=int, default=None, help="ProxySettings.max_body")
    parser.add_argument("--timeout", type=float, default=None, help="ProxySettings.timeout")
    parser.add_argument("--grace", type=float, default=0.0, help="drain on stop, seconds")
    parser.add_argument(
        "--healthz", action="store_true", help="also answer /healthz on a port of its own"
    )
    parser.add_argument(
        "--gate-budget", type=int, default=None, help="the gate on: this token budget, clamping"
    )
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
