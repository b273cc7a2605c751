"""``--web.config.file``: TLS and basic auth for the web port, in exporter-toolkit's format.

Prometheus' exporters share one web configuration file (the exporter-toolkit format); kvtax reads
the same file, so an operator can hand kvtax the file the node exporter already uses::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional, with client_ca_file
      client_ca_file: ca.crt
      min_version: TLS12             # TLS10..TLS13; max_version too
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hashes, as htpasswd -B or the toolkit make them

:func:`parse` checks the document (pure; an unknown or unsupported key is an error naming it);
:func:`load` reads the file and the certificates it names and returns a :class:`WebSecurity`:
an :class:`ssl.SSLContext` for the listener (None without TLS) and the basic-auth check.

Basic auth guards every route except ``/healthz`` and ``/readyz`` (kubelet probes carry no
credentials; they say only "ok") and the push route, which has its own bearer token. bcrypt is
slow by design, so a check runs in a thread (never on the event loop that relays the proxy's
streams), at most :data:`BCRYPT_THREADS` at once, and a user's good password is remembered (as a
keyed digest, never the password) so that Prometheus' scrape every few seconds costs one check.

Guessing can neither queue without end nor tell which names exist:

- each user name (known or not) has at most :data:`PER_USER_CHECKS` checks running or waiting,
  and all names together :data:`MAX_PENDING`; a login past either bound is answered ``busy``
  (429) at once, without a bcrypt check. A user whose password was checked before is answered
  from memory, so a flood of wrong guesses for that user never locks the real one out;
- an unknown name is checked against the configured hash of the highest cost, so it takes as
  long as the slowest known user's wrong password (the result is ignored);
- a hash that is not a well-formed bcrypt hash is refused at start, naming its user: bcrypt
  would refuse it at every login, and every login would be a silent 401.

Example::

    security = load(Path("web.yml"))
    security.ssl_context       # for aiohttp's TCPSite
    await security.authorized("Basic cHJvbWV0aGV1czpzZWNyZXQ=")  # True or False
    await security.verdict("Basic cHJvbWV0aGV1czpzZWNyZXQ=")     # "ok", "denied" or "busy"
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import re
import secrets
import ssl
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import yaml

from kvtax.errors import ConfigError

__all__ = [
    "BCRYPT_THREADS",
    "MAX_PENDING",
    "PER_USER_CHECKS",
    "VERIFIED_MAX",
    "BasicAuth",
    "TlsSettings",
    "Verdict",
    "WebSecurity",
    "load",
    "parse",
]

# bcrypt checks run in the loop's default thread pool, at most this many at once. That pool is
# small (cores + 4) and also resolves the proxy's upstream host name (getaddrinfo); on a 2-core
# pod a flood of bad guesses must neither fill it nor take every core from the event loop and
# the parse worker. Waiting checks queue as coroutines, which cost no thread.
BCRYPT_THREADS = 2
# Good (user, password) pairs remembered, as exporter-toolkit does: Prometheus sends the same
# credentials on every scrape, and each bcrypt check costs ~0.1 s of CPU at cost 10. Only
# successes are kept, so a guesser cannot fill it; the oldest entry goes first.
VERIFIED_MAX = 64
# bcrypt checks one user name (known or not) may have running or waiting for a thread, and all
# names together. Past them a login is answered "busy" (429) at once: 200 wrong guesses for one
# user then queue 2 checks, not 200, and a login of anyone else waits behind at most
# MAX_PENDING checks instead of every guess sent.
PER_USER_CHECKS = 2
MAX_PENDING = 16

Verdict = Literal["ok", "denied", "busy"]

# A bcrypt hash as htpasswd -B, the toolkit and the bcrypt libraries write it: the variant, a
# cost of 04-31, 22 characters of salt and 31 of hash in bcrypt's base64. The last character of
# each encodes only its top bits (16 bytes of salt in 22 characters, 23 of hash in 31), so it
# is one of a few; any other ending is a typo that no password can ever match.
_BCRYPT = re.compile(
    r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{21}[.Oeu][./A-Za-z0-9]{30}[.CGKOSWaeimquy26]"
)

_TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = MappingProxyType(
    {
        "TLS10": ssl.TLSVersion.TLSv1,
        "TLS11": ssl.TLSVersion.TLSv1_1,
        "TLS12": ssl.TLSVersion.TLSv1_2,
        "TLS13": ssl.TLSVersion.TLSv1_3,
    }
)
# exporter-toolkit's client_auth_type values kvtax can honour. Python's ssl module verifies
# every client certificate it asks for, so the two "ask but do not verify" types are refused.
_CLIENT_AUTH: Mapping[str, ssl.VerifyMode] = MappingProxyType(
    {
        "NoClientCert": ssl.CERT_NONE,
        "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
        "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    }
)
_UNVERIFIED_CLIENT_AUTH = frozenset({"RequestClientCert", "RequireAnyClientCert"})
_TOP_KEYS = frozenset({"tls_server_config", "basic_auth_users"})
_TLS_KEYS = frozenset(
    {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version"}
)


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """``tls_server_config``, paths already resolved against the file's folder."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    client_auth: ssl.VerifyMode = ssl.CERT_NONE
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion | None = None


@dataclass(frozen=True, slots=True)
class BasicAuth:
    """``basic_auth_users``: user name -> bcrypt hash, and the checks that already passed."""

    users: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}))
    # (user, keyed digest of the password) of good checks. The key is random per process, so a
    # digest seen in a memory dump cannot be matched against a precomputed table of passwords.
    _verified: OrderedDict[tuple[str, bytes], None] = field(
        default_factory=OrderedDict, init=False, repr=False, compare=False
    )
    _digest_key: bytes = field(
        default_factory=lambda: secrets.token_bytes(32), init=False, repr=False, compare=False
    )
    _threads: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(BCRYPT_THREADS),
        init=False,
        repr=False,
        compare=False,
    )
    # Checks running or waiting, by the user name the client gave; a name leaves at 0.
    _pending: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def decoy(self) -> bytes:
        """The hash an unknown name is checked against: the configured one of the highest
        cost, so an unknown name costs what the slowest known user's wrong password costs."""
        return max(self.users.values(), key=_cost)

    async def check(self, header: str | None) -> bool:
        """True when ``header`` (an Authorization value) names a user and its password."""
        return await self.verdict(header) == "ok"

    async def verdict(self, header: str | None) -> Verdict:
        """``ok`` for a user and its password, ``denied`` for anything else, ``busy`` when the
        name (or all names together) already has as many bcrypt checks pending as allowed:
        answered at once, without one."""
        credentials = _credentials(header)
        if credentials is None or not self.users:
            return "denied"
        user, password = credentials
        hashed = self.users.get(user)
        key = (user, hmac.digest(self._digest_key, password, "sha256"))
        if hashed is not None and key in self._verified:
            self._verified.move_to_end(key)
            return "ok"
        pending = self._pending
        if pending.get(user, 0) >= PER_USER_CHECKS or sum(pending.values()) >= MAX_PENDING:
            return "busy"
        pending[user] = pending.get(user, 0) + 1
        try:
            async with self._threads:
                # An unknown name gets the same bcrypt work as the costliest known user, so the
                # time of the answer does not tell which names exist (exporter-toolkit checks a
                # dummy hash). Its result is ignored: an unknown name never gets in.
                checked = self.decoy if hashed is None else hashed
                good = await asyncio.to_thread(_checkpw, password, checked)
        finally:
            left = pending[user] - 1
            if left:
                pending[user] = left
            else:
                del pending[user]
        if hashed is None or not good:
            return "denied"
        self._verified[key] = None
        if len(self._verified) > VERIFIED_MAX:
            self._verified.popitem(last=False)
        return "ok"


def _cost(hashed: bytes) -> int:
    """The cost of a checked bcrypt hash (``$2y$10$...`` -> 10)."""
    return int(hashed[4:6])


def _credentials(header: str | None) -> tuple[str, bytes] | None:
    """The user and password of a ``Basic`` Authorization value, or None."""
    if header is None:
        return None
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password.encode("utf-8")) if sep else None


def _checkpw(password: bytes, hashed: bytes) -> bool:
    """bcrypt's verdict; a password it refuses to check (bcrypt 5 raises ValueError past 72
    bytes) is a wrong one, not a server error."""
    import bcrypt  # only a file with basic_auth_users needs it

    try:
        return bool(bcrypt.checkpw(password, hashed))
    except (ValueError, TypeError):
        return False


@dataclass(frozen=True, slots=True)
class WebSettings:
    """The whole file, checked: TLS (or None) and basic auth (or None)."""

    tls: TlsSettings | None = None
    basic_auth: BasicAuth | None = None


@dataclass(frozen=True, slots=True)
class WebSecurity:
    """What the web listener applies: its TLS context and its basic-auth check."""

    ssl_context: ssl.SSLContext | None = None
    basic_auth: BasicAuth | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    async def authorized(self, header: str | None) -> bool:
        """True when no basic auth is configured, or ``header`` carries a valid user."""
        return await self.verdict(header) == "ok"

    async def verdict(self, header: str | None) -> Verdict:
        """``ok`` without basic auth; else :meth:`BasicAuth.verdict` of ``header``."""
        return "ok" if self.basic_auth is None else await self.basic_auth.verdict(header)


def _fail(file: Path, key: str, why: str) -> ConfigError:
    return ConfigError(f"--web.config.file={str(file)!r}: {key}: {why}")


def _mapping(value: Any, file: Path, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(file, key, "must be a mapping")
    return value


def _unknown(found: Mapping[str, Any], allowed: frozenset[str], file: Path, where: str) -> None:
    for key in found:
        if key not in allowed:
            raise _fail(
                file,
                f"{where}{key}",
                f"not supported by kvtax (known: {', '.join(sorted(allowed))})",
            )


def _version(raw: Any, file: Path, key: str) -> ssl.TLSVersion:
    if raw not in _TLS_VERSIONS:
        raise _fail(file, key, f"{raw!r} is not one of {', '.join(_TLS_VERSIONS)}")
    return _TLS_VERSIONS[raw]


def _path(raw: Any, file: Path, key: str) -> Path:
    if not isinstance(raw, str) or not raw:
        raise _fail(file, key, "must be a file path")
    path = Path(raw)
    return path if path.is_absolute() else file.parent / path


def _tls(raw: Any, file: Path) -> TlsSettings:
    where = "tls_server_config"
    tls = _mapping(raw, file, where)
    _unknown(tls, _TLS_KEYS, file, f"{where}.")
    for needed in ("cert_file", "key_file"):
        if needed not in tls:
            raise _fail(file, f"{where}.{needed}", "is required")
    ca = tls.get("client_ca_file")
    client_ca = _path(ca, file, f"{where}.client_ca_file") if ca is not None else None
    # As exporter-toolkit does: a CA without a type means clients must present a valid cert.
    auth_type = tls.get("client_auth_type") or (
        "RequireAndVerifyClientCert" if client_ca else "NoClientCert"
    )
    if auth_type in _UNVERIFIED_CLIENT_AUTH:
        raise _fail(
            file,
            f"{where}.client_auth_type",
            f"{auth_type} is not supported (kvtax verifies every client certificate it asks "
            "for): use VerifyClientCertIfGiven or RequireAndVerifyClientCert",
        )
    if auth_type not in _CLIENT_AUTH:
        raise _fail(file, f"{where}.client_auth_type", f"{auth_type!r} is not a known type")
    if _CLIENT_AUTH[auth_type] != ssl.CERT_NONE and client_ca is None:
        raise _fail(file, f"{where}.client_ca_file", f"is required with {auth_type}")
    max_raw = tls.get("max_version")
    return TlsSettings(
        cert_file=_path(tls["cert_file"], file, f"{where}.cert_file"),
        key_file=_path(tls["key_file"], file, f"{where}.key_file"),
        client_ca_file=client_ca,
        client_auth=_CLIENT_AUTH[auth_type],
        min_version=_version(tls.get("min_version", "TLS12"), file, f"{where}.min_version"),
        max_version=None if max_raw is None else _version(max_raw, file, f"{where}.max_version"),
    )


def _users(raw: Any, file: Path) -> BasicAuth:
    users = _mapping(raw, file, "basic_auth_users")
    hashes: dict[str, bytes] = {}
    for user, hashed in users.items():
        key = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user or ":" in user:
            raise _fail(file, key, "a user name must be non-empty text without ':'")
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise _fail(file, key, "must be a bcrypt hash ($2a$, $2b$ or $2y$...)")
        if _BCRYPT.fullmatch(hashed) is None:
            # The hash itself is never quoted: it is a secret's digest.
            raise _fail(
                file,
                key,
                f"user {user!r} has a malformed bcrypt hash: expected $2y$<cost 04-31>$ and 53 "
                "characters of bcrypt's base64, as htpasswd -B or bcrypt.hashpw write it; "
                "bcrypt would refuse it and every login of this user would fail",
            )
        hashes[user] = hashed.encode("ascii")
    return BasicAuth(MappingProxyType(hashes))


def parse(document: Any, file: Path) -> WebSettings:
    """Check a parsed web config document; ``file`` resolves relative paths and names errors."""
    if document is None:
        return WebSettings()
    top = _mapping(document, file, "the document")
    _unknown(top, _TOP_KEYS, file, "")
    tls = top.get("tls_server_config")
    users = top.get("basic_auth_users")
    return WebSettings(
        tls=_tls(tls, file) if tls is not None else None,
        basic_auth=_users(users, file) if users else None,
    )


def ssl_context(tls: TlsSettings, file: Path) -> ssl.SSLContext:
    """A server context from the settings: reads the certificate, key and client CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = tls.min_version
    if tls.max_version is not None:
        context.maximum_version = tls.max_version
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise _fail(file, "tls_server_config.cert_file/key_file", _reason(exc)) from None
    if tls.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise _fail(file, "tls_server_config.client_ca_file", _reason(exc)) from None
    context.verify_mode = tls.client_auth
    return context


def _reason(exc: OSError | ssl.SSLError) -> str:
    return str(exc.strerror or exc) if isinstance(exc, OSError) else str(exc)


def load(file: Path | None) -> WebSecurity:
    """Read and check ``file`` (None: plain HTTP, no auth); raises ConfigError naming the key."""
    if file is None:
        return WebSecurity()
    try:
        document = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--web.config.file={str(file)!r} is invalid: {exc.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        # Only where: PyYAML's message quotes the offending line, which may hold a hash.
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"--web.config.file={str(file)!r} is not YAML{where}") from None
    settings = parse(document, file)
    if settings.basic_auth is not None:
        try:
            import bcrypt  # noqa: F401 - fail at start, not at the first scrape
        except ImportError:
            raise _fail(file, "basic_auth_users", "needs the bcrypt package") from None
    context = ssl_context(settings.tls, file) if settings.tls is not None else None
    return WebSecurity(context, settings.basic_auth)
