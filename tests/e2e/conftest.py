"""Shared fixtures for end-to-end tests against a real vLLM CPU engine.

Starting vLLM takes 45-60 s here, so the whole session shares ONE engine. Tests must therefore
reason about counter *deltas*, never absolute values, and leave the engine idle.

The full suite runs in three lanes, three pytest processes side by side (scripts/test). Every
test that uses the session's engine carries the ``session_engine`` marker, added here: that lane
(``-m session_engine``) runs them one at a time on one engine that computes on core 0 (vLLM's
"auto" binding). A second lane takes the end-to-end tests that start an engine of their own
(bound to core 1, :func:`~kvtax_dev.testbed.engine.beside_cores`) or need none; a third the unit
tests and the packaging checks. Every engine, the benches' included, holds the machine's one
lock (:mod:`kvtax_dev.machine_lock`); the fleet's calm engine takes its core alone through it,
waiting for the other lane's engines there to end. The modules in :data:`LAST` run at the end
of the engine's lane, by when those have normally ended, so that wait is short: an order for
speed, not for correctness.

Tests marked ``plugins_off`` run after all of them: they need the session's engine restarted
with no plugin (:func:`engine_without_plugin`; the restart test in test_observe_e2e.py makes
that restart its own), and every other test needs kvtax's plugin loaded.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from kvtax_dev.testbed import EngineStartError, VllmEngine
from kvtax_dev.testbed.schedprobe import FLAG, probe_dir

_HERE = Path(__file__).resolve().parent


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    # A run stopped with SIGTERM (a CI timeout, `timeout`, kill) would otherwise skip fixture
    # teardown and leave the session's engine running; as an interrupt, teardown runs.
    signal.signal(signal.SIGTERM, _interrupt)
    # Registered here too so the marker is known even when pytest runs without the
    # project's ini settings (for example from another rootdir).
    config.addinivalue_line("markers", "e2e: needs a real vLLM engine (slow)")
    config.addinivalue_line("markers", "session_engine: uses the session's vLLM engine")
    config.addinivalue_line(
        "markers", "plugins_off: leaves the session's engine running without kvtax's plugin"
    )


# Tests in the modules named here run last in the engine's lane (see the module docstring).
LAST = ("test_fleet_e2e.py",)


# tryfirst: -m selects by the markers added here, in the mark plugin's hook of this name.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks in a conftest see every collected item, so mark only the ones under tests/e2e.
    for item in items:
        if item.path.resolve().is_relative_to(_HERE):
            item.add_marker(pytest.mark.e2e)
            if "vllm_engine" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.session_engine)
    # A stable sort: the LAST modules move to the end, the tests that turn the session engine's
    # plugin off after them; everything else keeps its order.
    items.sort(key=_place)


def _place(item: pytest.Item) -> int:
    if item.get_closest_marker("plugins_off") is not None:
        return 2
    return 1 if item.path.name in LAST else 0


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    """One real vLLM engine (16 KV blocks = 2,048 tokens, 64 seqs, every generation API) for the
    whole session.

    Fails, never skips, when the engine cannot start: a missing engine must not turn the
    end-to-end suite silently green.
    """
    # --enable-scale-out registers vLLM's tokens-in/tokens-out /inference/v1/generate (and its
    # render routes) beside the other generation APIs, which test_apis_e2e drives through kvtax.
    # The scheduler probe and vLLM's per-step details give test_offload_e2e its independent
    # count of recompute without a connector. A step can never schedule more new tokens than
    # the 2,048-token pool has free, so a 4,096-token budget changes no schedule; it only
    # states what that count assumes, that no prefill is cut into chunks.
    where = tmp_path_factory.mktemp("vllm")
    engine = VllmEngine(
        extra_args=["--enable-scale-out", FLAG, "--max-num-batched-tokens", "4096"],
        python_path=[probe_dir(where / "probe")],
        log_path=where / "engine.log",
    )
    try:
        engine.start()
    except EngineStartError as exc:
        pytest.fail(f"could not start the vLLM testbed engine: {exc}", pytrace=False)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def engine_without_plugin(request: pytest.FixtureRequest, vllm_engine: VllmEngine) -> VllmEngine:
    """The session's engine, restarted with no plugin unless a test already did so (one
    restart serves the restart test and this one). Only for tests marked ``plugins_off``, which
    run once no other test needs the plugin."""
    if request.node.get_closest_marker("plugins_off") is None:
        pytest.fail("engine_without_plugin is for tests marked plugins_off", pytrace=False)
    if not vllm_engine.plugins_off:
        vllm_engine.stop()
        vllm_engine.turn_plugins_off()
        try:
            vllm_engine.start()
        except EngineStartError as exc:
            pytest.fail(f"could not restart the engine without plugins: {exc}", pytrace=False)
    return vllm_engine
