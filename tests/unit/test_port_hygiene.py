"""No test picks a port before binding it (issue 35).

A port picked free and released, then bound later, can be taken in between by a test running
beside it (the suite runs three lanes at once, and xdist workers within the unit lane). The
servers the tests start bind port 0 and report what the kernel chose (``Proxy.start``,
``kvtax_dev.fakevllm.aio.serve``); an address where nothing listens is
``kvtax_dev.ports.refused_port``, held for as long as the test uses it.
"""

from __future__ import annotations

import socket

import pytest

from kvtax_dev import repo_root
from kvtax_dev.ports import refused_port

# Spelled in two parts so that this file does not name the helper it keeps out.
PICKER = "free" + "_port"


def test_no_test_picks_a_port_before_binding_it() -> None:
    tests = repo_root() / "tests"
    naming = sorted(
        str(path.relative_to(tests))
        for path in tests.rglob("*.py")
        if PICKER in path.read_text(encoding="utf-8")
    )
    assert naming == []


def test_a_refused_port_refuses_and_is_held_while_in_use() -> None:
    with refused_port() as port:
        with socket.socket() as client:
            assert client.connect_ex(("127.0.0.1", port)) != 0  # refused: nothing listens
        with socket.socket() as other, pytest.raises(OSError, match="already in use"):
            other.bind(("127.0.0.1", port))  # held: nothing else can take it meanwhile
