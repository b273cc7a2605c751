"""The measured tax with a stock vLLM: kvtax's plugin from a folder on PYTHONPATH, no rebuild.

This is what the Helm chart and the kustomize Component do in a pod: the kvtax image carries a
plugin folder made by ``pip install --no-deps --target`` from the kvtax wheel, an init container
copies it into an ``emptyDir``, and the vLLM container gets ``PYTHONPATH`` pointing there. Here
the folder is made the same way from this checkout's wheel, and a real vLLM CPU engine is started
with ``PYTHONPATH`` set to that folder alone.

The engine venv already has kvtax editable-installed (from the main checkout), so the test proves
which copy vLLM loaded: the plugin logs the folder it was imported from, and that must be the
plugin folder. ``PYTHONPATH`` entries come before site-packages, and ``importlib.metadata``
yields the first distribution of a name on ``sys.path``, so the folder's entry point and code
win. Then an overload goes through a real ``kvtax serve``, which must publish the measured tax.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtax import plugin
from kvtax_dev.exposition import read_series
from kvtax_dev.testbed import EngineStartError, VllmEngine
from kvtax_dev.testbed.load import drive
from kvtax_dev.testbed.sidecar import KvtaxProcess, series_key

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
# What the image's build context holds (.dockerignore): the wheel is built from these alone.
CONTEXT = ("pyproject.toml", "README.md", "LICENSE", "exporter")


def _run(argv: list[str], cwd: Path) -> None:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"


def build_plugin_dir(work: Path) -> Path:
    """The kvtax wheel of this checkout, installed with --no-deps --target, as the image does."""
    context = work / "context"
    context.mkdir()
    for name in CONTEXT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source,
                context / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "kvtax_dev"),
            )
        elif source.exists():
            shutil.copy2(source, context / name)
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), "."], cwd=context)
    target = work / "kvtax-plugin"
    install = ["install", "--no-deps", "--no-index", "--find-links", str(wheels)]
    _run([*pip, *install, "--target", str(target), "kvtax"], cwd=work)
    return target


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_plugin_dir(tmp_path_factory.mktemp("plugin-build"))


@pytest.fixture(scope="module")
def folder_engine(
    plugin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmEngine]:
    # PYTHONPATH is the folder alone, as in the pod: not the checkout's exporter/ that the
    # testbed puts there for its own child processes.
    engine = VllmEngine(
        extra_env={"PYTHONPATH": str(plugin_dir)},
        log_path=tmp_path_factory.mktemp("vllm-plugin-dir") / "engine.log",
    )
    try:
        engine.start()
    except EngineStartError as exc:
        pytest.fail(f"could not start vLLM with the plugin folder: {exc}", pytrace=False)
    try:
        yield engine
    finally:
        engine.stop()


def test_plugin_folder_holds_kvtax_alone_with_its_entry_point(plugin_dir: Path) -> None:
    top = sorted(p.name for p in plugin_dir.iterdir() if p.name != "bin")
    # kvtax and its dist-info only: vLLM already ships prometheus-client, and nothing of
    # kvtax's other dependencies (aiohttp, apscheduler, ...) may land next to vLLM.
    assert [n for n in top if not n.startswith("kvtax")] == []
    (dist_info,) = plugin_dir.glob("kvtax-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert f"{plugin.ENTRY_POINT_NAME} = kvtax.plugin:KvtaxStatLogger" in entry_points
    assert not (plugin_dir / "kvtax_dev").exists()


def test_vllm_loads_the_plugin_from_the_folder_and_kvtax_publishes_the_measured_tax(
    folder_engine: VllmEngine, plugin_dir: Path, tmp_path: Path
) -> None:
    log = folder_engine.log_path.read_text(errors="replace")
    loaded_from = [ln for ln in log.splitlines() if "kvtax plugin: loaded from" in ln]
    assert loaded_from, f"the plugin logged no load line:\n{folder_engine.log_tail()}"
    # The folder's copy, not the engine venv's editable install of the main checkout.
    assert all(ln.rstrip().endswith(str(plugin_dir / "kvtax")) for ln in loaded_from), loaded_from
    print(loaded_from[0])  # shown with -s: the evidence of which copy vLLM loaded
    assert "kvtax plugin: publishing exact recompute counters" in log
    page = read_series(folder_engine.metrics_text())
    for concept in plugin.PLUGIN_CONCEPTS:
        name = plugin.family_name(concept) + "_total"
        assert series_key(name, {"model_name": MODEL, "engine": "0"}) in page, name

    measured = series_key("kvtax_preemption_tax_ratio", {"model_name": MODEL, "method": "measured"})
    recomputed = series_key("kvtax_recomputed_tokens_measured_total", {"model_name": MODEL})
    with KvtaxProcess(
        folder_engine.url,
        proxy=True,
        scrape_interval="0.5s",
        window="1h",
        log_path=tmp_path / "kvtax.log",
    ) as kvtax:
        assert kvtax.proxy_url is not None
        kvtax.wait_for(lambda m: recomputed in m, what="the plugin's counter read by kvtax")
        # An overload of the 2,048-token pool: 32 streams of 300 tokens preempt.
        results = asyncio.run(
            drive(kvtax.proxy_url, MODEL, concurrency=32, max_tokens=300, stream=True)
        )
        assert [r.error for r in results if not r.ok] == []
        page_after = kvtax.wait_for(
            lambda m: m.get(recomputed, 0.0) > 0 and m.get(measured, 0.0) > 0,
            timeout=120.0,
            what="a measured tax above zero",
        )
    assert 0.0 < page_after[measured] < 1.0
    tax, tokens = page_after[measured], page_after[recomputed]
    print(f"measured tax {tax:.3f}, recomputed {tokens:.0f} tokens")
