"""The accounted relay in front of vLLM: asyncio Protocols, httptools parsers, one write per read.

The modules, in the order a request meets them:

- :mod:`~kvtax.serve.proxy.server`: the HTTP/1.1 server side: a client's connection, which
  parses bytes into exchanges, queues them and answers them in order; its flow control; and
  :class:`~kvtax.serve.proxy.server.Exchange`, one request and its answer from its head to its
  last byte (body, 100-continue, keep-alive, what is paused while the client is full);
- :mod:`~kvtax.serve.proxy.head`: the request head's checks and the path vLLM will route it by;
- :mod:`~kvtax.serve.proxy.proxy`: :class:`Proxy`, the lifecycle and the dispatch: a request to
  a generation API (:mod:`kvtax.delivery.dialects`) is accounted, any other passes through;
- :mod:`~kvtax.serve.proxy.request`: :class:`~kvtax.serve.proxy.request.AccountedRequest`,
  the one owner of an accounted request: prepare, admit, forward, relay, settle;
- :mod:`~kvtax.serve.proxy.prepare`: an accounted request's body, read once;
- :mod:`~kvtax.serve.proxy.gatekeeper`: the gate's queue and its one call, ``admit``;
- :mod:`~kvtax.serve.proxy.forward`: what every request sent to vLLM goes through, and the
  pass-through request;
- :mod:`~kvtax.serve.proxy.client`: the HTTP/1.1 client side: the keep-alive pool of
  connections to vLLM;
- :mod:`~kvtax.serve.proxy.relay`: vLLM's body to the client, read by read;
- :mod:`~kvtax.serve.proxy.acks`: what the client's TCP stack acknowledged;
- :mod:`~kvtax.serve.proxy.outcome`: an accounted request's facts, its outcome and its record;
- :mod:`~kvtax.serve.proxy.wire` and :mod:`~kvtax.serve.proxy.answers`: HTTP/1.1 bytes and
  kvtax's own answers.
"""

from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax.serve.proxy.proxy import Proxy, ProxySettings

__all__ = ["Gate", "GateSettings", "Proxy", "ProxySettings"]
