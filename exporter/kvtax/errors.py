"""kvtax's exceptions: one tree, rooted at :class:`KvtaxError`.

Every exception kvtax raises on purpose is in it. Three branches say who has to act: a person
who gave bad input, a client whose request kvtax refuses, or vLLM and the gateway kvtax reads.
Classes are defined here when their meaning is the whole of them; the ones that belong to one
module's work stay beside it (the module is named) and subclass a branch from here. This module
imports nothing from kvtax, so every layer, the pure engine included, can raise from the tree::

    KvtaxError                  anything kvtax raises on purpose
    ├── InputError              bad input from a person: a flag, a setting, a file; a ValueError
    │   │                       too. `kvtax` prints it as one line and exits 2. The load test and
    │   │                       annotate raise it as is.
    │   ├── ConfigError         a `kvtax serve` setting: its flag, variable or config file
    │   ├── RulesConfigError    the --config file of `kvtax rules` and `kvtax dashboards generate`
    │   └── PlanError           an input of `kvtax plan`: a flag, config.json or a metrics page
    ├── RequestError            a request to kvtax's server that it refuses (a 4xx); a ValueError
    │   ├── PushError           a malformed push body (kvtax.delivery.intake)
    │   └── BodyTooLarge        a body over its size limit (kvtax.serve.sources.bodies)
    ├── UpstreamError           vLLM or the gateway failed, or answered something unusable
    │   ├── ScrapeError         one scrape of vLLM's /metrics (kvtax.serve.scrape.scraper)
    │   ├── ParseError          a /metrics page kvtax cannot take (kvtax.engine.normalize)
    │   ├── AdapterError        /v1/models is no model list (kvtax.delivery.adapters)
    │   ├── GatewayError        the gateway's /metrics answer (kvtax.serve.sources.push)
    │   │   └── Redirected      the gateway answered with a redirect, which kvtax does not follow
    │   ├── Unreachable         the proxy could not reach vLLM (kvtax.serve.proxy.client)
    │   └── UpstreamBroke       vLLM's connection broke before its answer was whole (same module)
    └── PlotsUnavailable        matplotlib, the extra kvtax[report], is not installed
                                (kvtax.tools.loadtest.plots); a RuntimeError too

``except InputError`` is the one catch of the command line (:func:`kvtax.cli.main.main`); the
server answers a :class:`RequestError` itself and counts an :class:`UpstreamError` in its own
metrics, so neither reaches it. ``Cut`` in :mod:`kvtax.serve.proxy.client` is not in the tree:
it is the proxy's shutdown signal, not an error. ``tests/unit/test_errors.py`` checks that the
drawing names exactly the subclasses of :class:`KvtaxError`.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "InputError",
    "KvtaxError",
    "PlanError",
    "RequestError",
    "RulesConfigError",
    "UpstreamError",
]


class KvtaxError(Exception):
    """The root of the tree: anything kvtax raises on purpose."""


class InputError(KvtaxError, ValueError):
    """Input kvtax cannot use. ``str()`` is one line that names the field at fault first.

    ``InputError(field, message)`` gives ``<field>: <message>``, the message's lines joined by
    single spaces (a cause's text may span lines):

    >>> str(InputError("--levels", "must rise:\\n 4 after 8"))
    '--levels: must rise: 4 after 8'

    ``field`` and ``message`` are kept apart. :class:`ConfigError` and :class:`RulesConfigError`
    take one message that names the field in its own words; their ``field`` is None.
    """

    field: str | None
    message: str

    def __init__(self, field: str, message: str) -> None:
        self._set(field, message)

    def _set(self, field: str | None, message: str) -> None:
        self.field = field
        self.message = " ".join(filter(None, (line.strip() for line in message.splitlines())))
        super().__init__(self.message if field is None else f"{field}: {self.message}")


class ConfigError(InputError):
    """A ``kvtax serve`` setting is invalid; the message names the key, where it came from (flag,
    environment variable or config file) and the bad value:
    ``--scrape.interval='-1' is invalid: must be positive``."""

    def __init__(self, message: str) -> None:
        self._set(None, message)


class RulesConfigError(InputError):
    """A bad rules config file (``kvtax rules --config``, ``kvtax dashboards generate --config``);
    the message names the file and the key."""

    def __init__(self, message: str) -> None:
        self._set(None, message)


class PlanError(InputError):
    """Input ``kvtax plan`` cannot use; ``field`` names the flag, key or file at fault.

    >>> str(PlanError("--kv-dtype", "unknown dtype 'fp7'"))
    "--kv-dtype: unknown dtype 'fp7'"
    """


class RequestError(KvtaxError, ValueError):
    """A request to kvtax's own server that it refuses; the server answers it with a 4xx."""


class UpstreamError(KvtaxError):
    """vLLM or the gateway failed, or answered something kvtax cannot use."""
