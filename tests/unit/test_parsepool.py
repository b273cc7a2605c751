"""ParsePool: vLLM's page is parsed in a child process, which survives being killed."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from kvtax.engine.normalize import ParseError, normalize
from kvtax.serve.scrape.parsepool import ParsePool
from tests.unit.conftest import read_fixture


@pytest.fixture
def pool() -> Iterator[ParsePool]:
    p = ParsePool()
    yield p
    p.close()


async def test_the_worker_gives_what_normalize_gives(pool: ParsePool) -> None:
    text = read_fixture("0.32-preempting.prom")
    snap = await pool.normalize(text, timestamp=5.0, version="0.32.0", max_series=None)
    assert snap == normalize(text, timestamp=5.0, version="0.32.0")
    assert pool._proc is not None
    assert pool._proc.pid != os.getpid()


async def test_a_parse_error_keeps_its_reason_across_the_process(pool: ParsePool) -> None:
    with pytest.raises(ParseError) as caught:
        await pool.normalize("vllm:x 5", timestamp=0.0, version=None, max_series=None)
    assert caught.value.reason == "truncated"
    # The worker is still there for the next page.
    snap = await pool.normalize("", timestamp=0.0, version=None, max_series=None)
    assert snap.models == {}


async def test_a_killed_worker_is_replaced_at_the_next_page(pool: ParsePool) -> None:
    text = read_fixture("0.32-idle.prom")
    await pool.normalize(text, timestamp=0.0, version=None, max_series=None)
    assert pool._proc is not None
    first = pool._proc
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    snap = await pool.normalize(text, timestamp=1.0, version=None, max_series=None)
    assert "tiny-llama" in snap.models
    assert pool._proc is not None
    assert pool._proc.pid != first.pid


def test_close_ends_the_worker(pool: ParsePool) -> None:
    import asyncio

    asyncio.run(pool.normalize("", timestamp=0.0, version=None, max_series=None))
    proc = pool._proc
    assert proc is not None
    pool.close()
    assert proc.poll() is not None


async def test_only_models_the_sidecar_could_track_come_back(pool: ParsePool) -> None:
    lines = [f'vllm:num_requests_running{{model_name="m{i:04d}"}} 1\n' for i in range(5_000)]
    text = "# TYPE vllm:num_requests_running gauge\n" + "".join(lines)
    snap = await pool.normalize(
        text, timestamp=0.0, version=None, max_series=None, tracked={"m4999"}, max_models=4
    )
    assert sorted(snap.models) == ["m0000", "m0001", "m0002", "m4999"]
    assert snap.models_on_page == 5_000
