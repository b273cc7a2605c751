"""kvtax's proxy alone in a process of its own, on a port the kernel picks, for measurements of
its memory that the measuring process must not disturb (``python -m bench.proxy_child``).

It builds the proxy as ``kvtax serve`` does (its default settings, uvloop where installed) in
front of ``--upstream``, prints ``port <n>`` on a line of its own once it listens, and serves
until SIGTERM or SIGINT, then stops the proxy (``--grace`` seconds of drain). Used by
``tests/unit/test_front_door.py`` (the 20 MiB upload's RSS) and :mod:`bench.frontdoor`.

Example::

    python -m bench.proxy_child --upstream=http://127.0.0.1:8000 --max-body=4194304
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TypedDict

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.serve.proxy import Proxy, ProxySettings

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
    proxy = Proxy(ProxySettings(upstream=args.upstream, **settings), DeliveryLedger(names))
    port = await proxy.start("127.0.0.1", 0)
    print(f"port {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.stop(args.grace)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="vLLM's URL")
    parser.add_argument("--max-body", type=int, default=None, help="ProxySettings.max_body")
    parser.add_argument("--timeout", type=float, default=None, help="ProxySettings.timeout")
    parser.add_argument("--grace", type=float, default=0.0, help="drain on stop, seconds")
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
