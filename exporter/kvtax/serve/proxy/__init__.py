"""The accounted relay in front of vLLM: asyncio Protocols, httptools parsers, one write per read.

The modules, in the order a request meets them:

- :mod:`~kvtax.serve.proxy.client`: a client's connection; parses requests, queues them,
  answers them in order, and turns a full socket into a paused upstream;
- :mod:`~kvtax.serve.proxy.proxy`: :class:`Proxy`, the lifecycle and what happens to each
  request (the gate, vLLM, the ledger);
- :mod:`~kvtax.serve.proxy.prepare`: an accounted request's body, read once;
- :mod:`~kvtax.serve.proxy.upstream`: the keep-alive pool of connections to vLLM;
- :mod:`~kvtax.serve.proxy.relay`: vLLM's body to the client, read by read;
- :mod:`~kvtax.serve.proxy.acks`: what the client's TCP stack acknowledged;
- :mod:`~kvtax.serve.proxy.exchange`: one request's facts, its outcome and its record;
- :mod:`~kvtax.serve.proxy.wire` and :mod:`~kvtax.serve.proxy.answers`: HTTP/1.1 bytes and
  kvtax's own answers.
"""

from kvtax.serve.proxy.proxy import ACCOUNTED_PATHS, UPSTREAM_IDLE, Proxy, ProxySettings

__all__ = ["ACCOUNTED_PATHS", "UPSTREAM_IDLE", "Proxy", "ProxySettings"]
