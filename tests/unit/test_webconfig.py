"""``--web.config.file``: the exporter-toolkit format read, checked and applied to the web port.

The file's errors name the key; a real TLS handshake (server certificate, client certificates
required or not) and basic auth are checked against kvtax's own web port on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import bcrypt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvtax.errors import ConfigError
from kvtax.serve.config import load_config
from kvtax.serve.scrape.job import ScrapeJob
from kvtax.serve.web.port import WebPort
from kvtax.serve.web.webconfig import (
    BCRYPT_THREADS,
    MAX_PENDING,
    PER_USER_CHECKS,
    VERIFIED_MAX,
    BasicAuth,
    WebSecurity,
    load,
    parse,
)
from kvtax_dev.testbed.tlscerts import Certs, make_certs
from tests.unit.conftest import web_port

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return path


# -- the file -------------------------------------------------------------------------------


async def test_no_file_means_plain_http_without_auth() -> None:
    security = load(None)
    assert security.ssl_context is None
    assert security.scheme == "http"
    assert await security.authorized(None)


def test_an_empty_file_changes_nothing(tmp_path: Path) -> None:
    security = load(write(tmp_path, ""))
    assert security.ssl_context is None
    assert security.basic_auth is None


def test_relative_paths_are_relative_to_the_file() -> None:
    file = Path("/etc/kvtax/web.yml")
    settings = parse(
        {"tls_server_config": {"cert_file": "tls.crt", "key_file": "/abs/tls.key"}}, file
    )
    assert settings.tls is not None
    assert settings.tls.cert_file == Path("/etc/kvtax/tls.crt")
    assert settings.tls.key_file == Path("/abs/tls.key")
    assert settings.tls.min_version == ssl.TLSVersion.TLSv1_2  # exporter-toolkit's default


def test_a_client_ca_without_a_type_requires_verified_client_certs() -> None:
    settings = parse(
        {"tls_server_config": {"cert_file": "a", "key_file": "b", "client_ca_file": "ca"}},
        Path("/x/web.yml"),
    )
    assert settings.tls is not None
    assert settings.tls.client_auth == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"tls_config": {}}, "tls_config: not supported"),
        ({"tls_server_config": {"cert_file": "a"}}, "tls_server_config.key_file: is required"),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "cipher_suites": []}},
            "tls_server_config.cipher_suites: not supported",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "TLS9"}},
            "tls_server_config.min_version: 'TLS9' is not one of",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "tls_server_config.client_ca_file: is required",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequestClientCert",
                }
            },
            "RequestClientCert is not supported",
        ),
        ({"basic_auth_users": {"prometheus": "plain"}}, "basic_auth_users.prometheus: must be"),
        ({"basic_auth_users": ["prometheus"]}, "basic_auth_users: must be a mapping"),
    ],
)
def test_a_bad_file_names_the_key(document: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=r"--web.config.file='/x/web.yml'") as caught:
        parse(document, Path("/x/web.yml"))
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "hashed",
    [
        "$2y$10$thisisnotavalidbcrypthash",  # the issue's: bcrypt refuses it at every login
        HASH[:-1],  # cut short by a copy and paste
        HASH + "x",  # one character too many
        HASH[:-1] + "z",  # a last character no bcrypt hash ends with
        HASH[:28] + "z" + HASH[29:],  # a salt bcrypt refuses ("Invalid salt")
        "$2b$03$" + HASH[7:],  # below bcrypt's lowest cost
        "$2b$32$" + HASH[7:],  # above its highest
        "$2b$10$" + "!" * 53,  # not bcrypt's base64
    ],
    ids=["issue", "short", "long", "last-char", "salt", "cost-03", "cost-32", "alphabet"],
)
def test_a_malformed_bcrypt_hash_is_refused_at_start_naming_the_user(
    tmp_path: Path, hashed: str
) -> None:
    # Protection: accepted, such a hash makes every login of the user a silent 401.
    path = write(tmp_path, f"basic_auth_users:\n  alice: '{HASH}'\n  bob: '{hashed}'\n")
    with pytest.raises(ConfigError) as caught:
        load(path)
    message = str(caught.value)
    assert "basic_auth_users.bob: user 'bob' has a malformed bcrypt hash" in message
    assert hashed not in message  # a secret's digest is never quoted


def test_every_well_formed_bcrypt_variant_is_accepted(tmp_path: Path) -> None:
    hashes = {
        "a": "$2a$" + HASH[4:],
        "b": "$2b$" + HASH[4:],
        "y": "$2y$" + HASH[4:],
        "costly": bcrypt.hashpw(b"x", bcrypt.gensalt(rounds=5)).decode(),
    }
    lines = "".join(f"  {user}: '{hashed}'\n" for user, hashed in hashes.items())
    security = load(write(tmp_path, "basic_auth_users:\n" + lines))
    assert security.basic_auth is not None
    assert set(security.basic_auth.users) == set(hashes)


def test_a_missing_certificate_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "tls_server_config: {cert_file: nope.crt, key_file: nope.key}\n")
    with pytest.raises(ConfigError, match="cert_file/key_file"):
        load(path)


def test_a_missing_file_and_bad_yaml_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load(tmp_path / "absent.yml")
    with pytest.raises(ConfigError, match="is not YAML"):
        load(write(tmp_path, "basic_auth_users: [unclosed\n"))


def test_the_flag_and_the_variable_set_it(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    config = load_config({"web.config.file": str(path)}, env={}, file=None)
    assert config.web_config_file == path
    config = load_config({}, env={"KVTAX_WEB_CONFIG_FILE": str(path)}, file=None)
    assert config.web_config_file == path


# -- basic auth -----------------------------------------------------------------------------


async def test_basic_auth_checks_the_bcrypt_hash() -> None:
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert await auth.check(basic("prometheus", "s3cret"))
    assert not await auth.check(basic("prometheus", "wrong"))
    assert not await auth.check(basic("someone", "s3cret"))
    assert not await auth.check(None)
    assert not await auth.check("Bearer s3cret")
    assert not await auth.check("Basic !!!not-base64")


def count_checks(monkeypatch: pytest.MonkeyPatch, verdict: bool | None = None) -> list[bytes]:
    """Every password bcrypt is asked to check, in order; ``verdict`` overrides its answer."""
    asked: list[bytes] = []
    real = bcrypt.checkpw

    def checkpw(password: bytes, hashed: bytes) -> bool:
        asked.append(password)
        return real(password, hashed) if verdict is None else verdict

    monkeypatch.setattr(bcrypt, "checkpw", checkpw)
    return asked


async def test_a_good_password_costs_one_bcrypt_check_and_a_bad_one_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = count_checks(monkeypatch)
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert await auth.check(basic("prometheus", "s3cret"))
    assert await auth.check(basic("prometheus", "s3cret"))
    assert asked == [b"s3cret"]  # the second scrape was answered from the remembered check
    assert not await auth.check(basic("prometheus", "wrong"))
    assert not await auth.check(basic("prometheus", "wrong"))
    assert asked == [b"s3cret", b"wrong", b"wrong"]
    assert b"s3cret" not in repr(auth).encode()


async def test_an_unknown_user_costs_the_same_bcrypt_check_and_never_gets_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Protection: refusing an unknown name without bcrypt's work answers faster, and the time
    # tells which user names exist.
    asked = count_checks(monkeypatch, verdict=True)  # even a hash that would match
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert not await auth.check(basic("someone", "s3cret"))
    assert asked == [b"s3cret"]


async def test_an_unknown_name_is_checked_against_the_costliest_hash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Protection: checked against the first (cheapest) hash, an unknown name is answered
    # faster than a wrong password of the costly user, and the time tells that name exists.
    cheap = bcrypt.hashpw(b"a", bcrypt.gensalt(rounds=4))
    costly = bcrypt.hashpw(b"b", bcrypt.gensalt(rounds=6))
    checked: list[bytes] = []
    monkeypatch.setattr(bcrypt, "checkpw", lambda password, hashed: checked.append(hashed))
    for users in ({"cheap": cheap, "costly": costly}, {"costly": costly, "cheap": cheap}):
        checked.clear()
        auth = BasicAuth(users)
        assert await auth.verdict(basic("nobody", "b")) == "denied"
        assert await auth.verdict(basic("costly", "wrong")) == "denied"
        assert checked == [costly, costly]


class BlockedBcrypt:
    """bcrypt.checkpw held until :meth:`release`: every check it was asked for, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked: list[bytes] = []
        self.gate = threading.Event()
        self.lock = threading.Lock()
        real = bcrypt.checkpw

        def checkpw(password: bytes, hashed: bytes) -> bool:
            with self.lock:
                self.asked.append(password)
            self.gate.wait(timeout=30.0)  # released by the test; the bound only frees a thread
            return bool(real(password, hashed))

        monkeypatch.setattr(bcrypt, "checkpw", checkpw)

    def release(self) -> None:
        self.gate.set()


async def _steps(n: int = 20) -> None:
    """Let the loop run every task that can go on without a thread's answer."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_guesses_past_the_per_user_bound_are_busy_at_once_and_a_known_login_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Protection: without a bound, 200 guesses queue 200 bcrypt checks and the real user's
    # login waits behind all of them (56 s on 2 threads); without the remembered check, it
    # waits for a free thread even then.
    auth = BasicAuth({"prometheus": HASH.encode(), "other": HASH.encode()})
    assert await auth.verdict(basic("prometheus", "s3cret")) == "ok"  # verified once
    blocked = BlockedBcrypt(monkeypatch)
    try:
        held = [
            asyncio.ensure_future(auth.verdict(basic("prometheus", f"guess{n}")))
            for n in range(PER_USER_CHECKS)
        ]
        await _steps()
        extra = [
            asyncio.ensure_future(auth.verdict(basic("prometheus", f"more{n}"))) for n in range(200)
        ]
        await _steps()
        assert all(task.done() for task in extra)
        assert {task.result() for task in extra} == {"busy"}
        assert not any(task.done() for task in held)
        # The real user, verified before, is answered from memory: no bcrypt call, no wait.
        assert await auth.verdict(basic("prometheus", "s3cret")) == "ok"
        # Another user's login is not refused for the first user's guesses.
        other = asyncio.ensure_future(auth.verdict(basic("other", "s3cret")))
        await _steps()
        assert not other.done()
        assert len(blocked.asked) <= BCRYPT_THREADS
    finally:
        blocked.release()
    assert [await task for task in held] == ["denied"] * PER_USER_CHECKS
    assert await other == "ok"
    assert sorted(blocked.asked) == sorted(
        [f"guess{n}".encode() for n in range(PER_USER_CHECKS)] + [b"s3cret"]
    )


async def test_pending_checks_of_all_names_together_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Protection: a guesser that varies the name fills no queue past MAX_PENDING either.
    auth = BasicAuth({"prometheus": HASH.encode()})
    blocked = BlockedBcrypt(monkeypatch)
    try:
        tasks = [
            asyncio.ensure_future(auth.verdict(basic(f"name{n}", "guess")))
            for n in range(MAX_PENDING + 50)
        ]
        await _steps()
        busy = [task for task in tasks if task.done()]
        assert len(busy) == 50
        assert {task.result() for task in busy} == {"busy"}
    finally:
        blocked.release()
    assert {await task for task in tasks} == {"busy", "denied"}
    assert len(blocked.asked) == MAX_PENDING


async def test_a_busy_login_is_a_429_and_healthz_never_waits(
    aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await aiohttp_client(basic_auth_port().app())
    blocked = BlockedBcrypt(monkeypatch)
    try:
        guesses = [
            asyncio.ensure_future(
                client.get("/metrics", headers={"Authorization": basic("prometheus", f"g{n}")})
            )
            for n in range(PER_USER_CHECKS)
        ]
        while len(blocked.asked) < min(PER_USER_CHECKS, BCRYPT_THREADS):
            await asyncio.sleep(0.01)
        resp = await client.get("/metrics", headers={"Authorization": basic("prometheus", "x")})
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "1"
        assert (await client.get("/healthz")).status == 200
    finally:
        blocked.release()
    assert [(await g).status for g in guesses] == [401] * PER_USER_CHECKS


async def test_the_remembered_checks_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = count_checks(monkeypatch, verdict=True)
    auth = BasicAuth({"prometheus": HASH.encode()})
    for n in range(VERIFIED_MAX + 1):
        assert await auth.check(basic("prometheus", f"p{n}"))
    assert await auth.check(basic("prometheus", f"p{VERIFIED_MAX}"))
    assert len(asked) == VERIFIED_MAX + 1  # the newest is still remembered
    assert await auth.check(basic("prometheus", "p0"))
    assert len(asked) == VERIFIED_MAX + 2  # the oldest was forgotten


def basic_auth_port() -> WebPort:
    config = load_config({"vllm.url": "http://127.0.0.1:9"}, env={}, file=None)
    users = BasicAuth({"prometheus": HASH.encode()})
    return web_port(ScrapeJob(config), security=WebSecurity(basic_auth=users))


async def test_a_password_longer_than_bcrypt_takes_is_401_not_500(aiohttp_client: Any) -> None:
    client = await aiohttp_client(basic_auth_port().app())
    long = {"Authorization": basic("prometheus", "x" * 73)}  # bcrypt 5 raises past 72 bytes
    resp = await client.get("/metrics", headers=long)
    assert resp.status == 401
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert not await auth.check(basic("prometheus", "é" * 40))  # 80 bytes in UTF-8


async def test_at_most_a_few_bcrypt_checks_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    running, most = 0, 0
    lock = threading.Lock()
    guesses_made = 4 * BCRYPT_THREADS
    # The checks pass in groups of BCRYPT_THREADS: each holds its thread until that many run at
    # once, however slow the machine is to start the next; with fewer allowed the group never
    # fills (the wait times out and the check raises), and with more, the next starts while
    # a group holds.
    together = threading.Barrier(BCRYPT_THREADS, timeout=5.0)

    def slow_checkpw(password: bytes, hashed: bytes) -> bool:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        together.wait()
        time.sleep(0.05)  # room for a check past the bound to start beside them, were it let
        with lock:
            running -= 1
        return False

    monkeypatch.setattr(bcrypt, "checkpw", slow_checkpw)
    auth = BasicAuth({"prometheus": HASH.encode()})
    guesses = [auth.check(basic("prometheus", f"guess{n}")) for n in range(guesses_made)]
    assert not any(await asyncio.gather(*guesses))
    assert most == BCRYPT_THREADS


async def test_the_event_loop_serves_other_requests_while_bcrypt_runs(
    aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def slow_checkpw(password: bytes, hashed: bytes) -> bool:
        entered.set()
        # Released by the test once /healthz answered; on the event loop it would block that
        # answer, and the wait ends by its timeout instead.
        release.wait(timeout=2.0)
        order.append("bcrypt done")
        return True

    monkeypatch.setattr(bcrypt, "checkpw", slow_checkpw)
    client = await aiohttp_client(basic_auth_port().app())
    ok = {"Authorization": basic("prometheus", "s3cret")}
    scrape = asyncio.ensure_future(client.get("/metrics", headers=ok))
    assert await asyncio.to_thread(entered.wait, 5.0)
    resp = await client.get("/healthz")
    assert resp.status == 200
    order.append("healthz answered")
    release.set()
    assert (await scrape).status == 200
    assert order == ["healthz answered", "bcrypt done"]


# -- on the wire ----------------------------------------------------------------------------


@pytest.fixture
def web_file(tmp_path: Path, certs: Certs) -> Path:
    return write(
        tmp_path,
        f"tls_server_config:\n"
        f"  cert_file: {certs.server_cert}\n"
        f"  key_file: {certs.server_key}\n"
        f"  client_ca_file: {certs.ca}\n"
        f"  client_auth_type: VerifyClientCertIfGiven\n"
        f"basic_auth_users:\n"
        f"  prometheus: '{HASH}'\n",
    )


async def push(request: web.Request) -> web.Response:
    return web.Response(text="pushed\n")


async def serve(web_file: Path) -> TestServer:
    config = load_config({"vllm.url": "http://127.0.0.1:9"}, env={}, file=None)
    security = load(web_file)
    port = web_port(
        ScrapeJob(config), security=security, routes=[web.post("/api/v1/delivered", push)]
    )
    server = TestServer(port.app(), host="127.0.0.1")
    await server.start_server(ssl=security.ssl_context)
    return server


async def test_tls_and_basic_auth_guard_the_metrics_page_only(web_file: Path, certs: Certs) -> None:
    server = await serve(web_file)
    url = f"https://127.0.0.1:{server.port}"
    trust = ssl.create_default_context(cafile=str(certs.ca))
    try:
        async with aiohttp.ClientSession() as session:
            ok = {"Authorization": basic("prometheus", "s3cret")}
            async with session.get(url + "/metrics", ssl=trust, headers=ok) as resp:
                assert resp.status == 200
                assert "kvtax_vllm_up" in await resp.text()
            async with session.get(url + "/metrics", ssl=trust) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"].startswith("Basic")
            bad = {"Authorization": basic("prometheus", "guess")}
            async with session.get(url + "/metrics", ssl=trust, headers=bad) as resp:
                assert resp.status == 401
            # Probes and the push route (its own bearer token) pass without basic auth.
            async with session.get(url + "/healthz", ssl=trust) as resp:
                assert resp.status == 200
            async with session.post(url + "/api/v1/delivered", ssl=trust) as resp:
                assert resp.status == 200
            # Plain HTTP on the TLS port gets no page.
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{server.port}/healthz") as resp:
                    await resp.read()
    finally:
        await server.close()


async def test_required_client_certificates_refuse_a_client_without_one(
    tmp_path: Path, certs: Certs
) -> None:
    path = write(
        tmp_path,
        f"tls_server_config:\n  cert_file: {certs.server_cert}\n  key_file: {certs.server_key}\n"
        f"  client_ca_file: {certs.ca}\n",
    )
    server = await serve(path)
    url = f"https://127.0.0.1:{server.port}/healthz"
    with_cert = ssl.create_default_context(cafile=str(certs.ca))
    with_cert.load_cert_chain(certs.client_cert, certs.client_key)
    without = ssl.create_default_context(cafile=str(certs.ca))
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url, ssl=with_cert) as resp:
                assert resp.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with session.get(url, ssl=without) as resp:
                    await resp.read()
    finally:
        await server.close()


def test_serve_refuses_a_bad_file_in_one_line_before_listening(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtax.cli.main import main
    from kvtax.serve import logformat

    # Leave the test runner's logging as it is.
    monkeypatch.setattr(logformat, "install", lambda level, name: None)

    path = write(tmp_path, "tls_server_config: {cert_file: x.crt}\n")
    args = ["serve", f"--web.config.file={path}", "--proxy.listen-address=off"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "tls_server_config.key_file: is required" in err
