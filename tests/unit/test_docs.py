"""Generated references must match the code they are generated from."""

from __future__ import annotations

import re
from pathlib import Path

from kvtax.cli import main
from kvtax.engine import vocabulary
from kvtax.expose import catalog
from kvtax.serve import config

ROOT = Path(__file__).resolve().parents[2]


def test_metrics_reference_matches_catalog() -> None:
    assert (ROOT / "docs/metrics.md").read_text() == catalog.render_markdown()


def test_configuration_reference_matches_options() -> None:
    assert (ROOT / "docs/configuration.md").read_text() == config.render_markdown()


def test_compatibility_page_matches_vocabulary() -> None:
    assert (ROOT / "docs/compatibility.md").read_text() == vocabulary.render_markdown()


def test_docs_check_detects_drift(tmp_path: Path) -> None:
    assert main(["docs", "--out", str(tmp_path)]) == 0
    assert main(["docs", "--out", str(tmp_path), "--check"]) == 0
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text().replace("kvtax_vllm_up", "kvtax_vllm_upp"))
    assert main(["docs", "--out", str(tmp_path), "--check"]) == 1


def test_every_catalog_metric_is_documented_in_the_reference() -> None:
    text = (ROOT / "docs/metrics.md").read_text()
    documented = set(re.findall(r"^\| `(kvtax_[a-z0-9_]+)`", text, flags=re.M))
    assert documented == set(catalog.METRICS)


def test_every_flag_is_documented() -> None:
    text = (ROOT / "docs/configuration.md").read_text()
    for option in config.OPTIONS:
        assert f"`{option.flag}`" in text
        assert f"`{config.env_name(option.key)}`" in text
