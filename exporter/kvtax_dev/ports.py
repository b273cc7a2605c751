"""Ports for tests and benches, without the race between picking a port and binding it.

A server the harness starts itself binds port 0 and reports the port the kernel chose
(``Proxy.start``, :func:`kvtax_dev.fakevllm.aio.serve`). What is left is the address where
nothing listens, for a vLLM that is down: :func:`refused_port` holds a socket bound to a port
without listening on it, so a connect there is refused (ECONNREFUSED) and, while it is held, no
other process can take the port. A port picked and released first, as ``free_port()`` gives it,
can be bound by a parallel test between the pick and its use.

Example::

    with refused_port() as port:
        proxy = Proxy(ProxySettings(upstream=f"http://127.0.0.1:{port}"), ledger)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` where a connect is refused, reserved for as long as the block runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        yield int(sock.getsockname()[1])
