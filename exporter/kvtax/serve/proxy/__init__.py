"""The accounted relay in front of vLLM: asyncio Protocols, httptools parsers, one write per read.

The modules, in the order a request meets them:

- :mod:`~kvtax.serve.proxy.client`: a client's connection; parses bytes into exchanges, queues
  them, answers them in order, and bounds what one connection may hold;
- :mod:`~kvtax.serve.proxy.head`: the request head's checks and the path vLLM will route it by;
- :mod:`~kvtax.serve.proxy.exchange`: :class:`~kvtax.serve.proxy.exchange.Exchange`, one
  request and its answer, from its head to its last byte: body, 100-continue, keep-alive,
  flow control;
- :mod:`~kvtax.serve.proxy.proxy`: :class:`Proxy`, the lifecycle and what happens to each
  request (the gate, vLLM, the ledger);
- :mod:`~kvtax.serve.proxy.prepare`: an accounted request's body, read once;
- :mod:`~kvtax.serve.proxy.gate`: the gate's queue and its one call, ``admit``;
- :mod:`~kvtax.serve.proxy.upstream`: the keep-alive pool of connections to vLLM;
- :mod:`~kvtax.serve.proxy.relay`: vLLM's body to the client, read by read;
- :mod:`~kvtax.serve.proxy.acks`: what the client's TCP stack acknowledged;
- :mod:`~kvtax.serve.proxy.outcome`: an accounted request's facts, its outcome and its record;
- :mod:`~kvtax.serve.proxy.wire` and :mod:`~kvtax.serve.proxy.answers`: HTTP/1.1 bytes and
  kvtax's own answers.
"""

from kvtax.serve.proxy.proxy import ACCOUNTED_PATHS, UPSTREAM_IDLE, Proxy, ProxySettings

__all__ = ["ACCOUNTED_PATHS", "UPSTREAM_IDLE", "Proxy", "ProxySettings"]
