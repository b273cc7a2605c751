"""Generated references must match the code they are generated from."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

from kvtax.cli.main import main
from kvtax.engine import vocabulary
from kvtax.expose import catalog, reference
from kvtax.serve import config
from kvtax_dev.dashboard_lint import panels

ROOT = Path(__file__).resolve().parents[2]


def test_metrics_reference_matches_catalog() -> None:
    assert (ROOT / "docs/metrics.md").read_text() == reference.render_markdown()


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
    text = (ROOT / "docs/metrics.md").read_text().split(reference.CHANGES_HEADING)[0]
    documented = set(re.findall(r"^\| `(kvtax_[a-z0-9_]+)`", text, flags=re.M))
    assert documented == set(catalog.METRICS)


def test_every_flag_is_documented() -> None:
    text = (ROOT / "docs/configuration.md").read_text()
    for option in config.OPTIONS:
        assert f"`{option.flag}`" in text
        assert f"`{config.env_name(option.key)}`" in text


# -- the 0.2 changes -------------------------------------------------------------------------

# Where users read metric names: the generated rules and dashboards, their generators, the docs.
_SCANNED = (
    "alerts",
    "dashboards",
    "docs",
    "deploy",
    "exporter/kvtax/rules",
    "exporter/kvtax/dashboards",
)
_SUFFIXES = {".md", ".yaml", ".yml", ".json", ".py"}
# Not yet updated by their owner (the delivery page's table of gauges); remove once it is.
_PENDING: set[str] = set()


def _scanned_texts() -> dict[str, str]:
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for folder in _SCANNED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in _SUFFIXES and path.is_file():
                texts[str(path.relative_to(ROOT))] = path.read_text()
    metrics = texts["docs/metrics.md"]
    texts["docs/metrics.md"] = metrics.split(reference.CHANGES_HEADING)[0]
    return {name: text for name, text in texts.items() if name not in _PENDING}


def test_the_changes_of_0_2_are_in_the_metrics_reference() -> None:
    text = (ROOT / "docs/metrics.md").read_text()
    changes = text.split(reference.CHANGES_HEADING)[1]
    assert reference.REMOVED_0_2
    for name in reference.REMOVED_0_2:
        assert f"`{name}" in changes, name
    assert 'outcome="rejected"' in changes
    # A removed name is removed: the catalog publishes none of them.
    assert not reference.REMOVED_0_2 & set(catalog.METRICS)


def test_no_removed_metric_survives_outside_the_changes_table() -> None:
    texts = _scanned_texts()
    assert {"alerts/kvtax-alerts.yaml", "dashboards/kvtax-overview.json"} <= set(texts)
    found = {
        (name, path)
        for path, text in texts.items()
        for name in reference.REMOVED_0_2
        if re.search(rf"\b{name}\b", text)
    }
    assert found == set()


def test_no_rule_dashboard_or_doc_counts_kvtax_rejections_or_its_429s() -> None:
    for path, text in _scanned_texts().items():
        assert 'outcome="rejected"' not in text, path
        assert "kvtax 429" not in text.lower(), path
        assert "kvtax's admission gate" not in text.lower(), path


# -- vLLM's own admission limits and --max-num-active-seqs (vLLM 0.33+) ----------------------


def _runbook_sections() -> dict[str, str]:
    text = (ROOT / "docs/runbooks.md").read_text()
    return {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}


def test_vllm_rejections_are_503s_and_active_seqs_is_advised_beside_max_num_seqs() -> None:
    # vLLM answers --max-num-queued-reqs/-tokens with 503, which the proxy files as upstream_error.
    sections = _runbook_sections()
    shedding = sections["KvtaxLoadShedding"]
    assert "503" in shedding
    assert 'outcome="upstream_error"' in shedding
    assert "503" in catalog.METRICS["kvtax_requests_total"].help
    delivery = (ROOT / "docs/delivery.md").read_text()
    line_4xx = next(line for line in delivery.splitlines() if "- `upstream_4xx`:" in line)
    assert "admission" not in line_4xx
    boards = [json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))]
    described = {p["title"]: p.get("description", "") for d in boards for p in panels(d)}
    assert "503" in described["Rejected requests"]
    assert "upstream_error" in described["Rejected requests"]
    # Drift: wherever --max-num-seqs is advised, so is --max-num-active-seqs.
    advising = {title for title, s in sections.items() if "`--max-num-seqs`" in s}
    assert {"KvtaxVllmPreempting", "KvtaxOverAdmitted", "KvtaxStreamStalls"} <= advising
    assert {t for t in advising if "`--max-num-active-seqs`" not in sections[t]} == set()
    panels_advising = {t for t, d in described.items() if "--max-num-seqs" in d}
    assert "max_num_seqs: recommended / configured" in panels_advising
    assert {t for t in panels_advising if "--max-num-active-seqs" not in described[t]} == set()


# The package's top-level modules: a backticked name under one of them is a Python name (the
# Helm chart's values, `kvtax.proxy.enabled` say, are not).
_TOP = {path.stem for path in (ROOT / "exporter/kvtax").iterdir() if not path.stem.startswith("_")}
_DOTTED = re.compile(r"`(kvtax(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def resolves(name: str) -> bool:
    """``name`` is a module of kvtax, or an attribute (a class, function, constant) of one."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_every_dotted_name_in_the_docs_resolves() -> None:
    named = {
        (page.name, name)
        for page in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "SECURITY.md"]
        for name in _DOTTED.findall(page.read_text())
        if name.split(".")[1] in _TOP
    }
    assert named, "no dotted name found: the pattern no longer matches the docs"
    unresolved = sorted(f"{page}: {name}" for page, name in named if not resolves(name))
    assert not unresolved, unresolved


def test_a_name_that_moved_does_not_resolve() -> None:
    assert resolves("kvtax.serve.proxy.outcome.outcome_of")
    assert not resolves("kvtax.serve.proxy.exchange.outcome_of")
    assert not resolves("kvtax.serve.proxy.outcome.no_such_function")


def test_the_api_series_help_names_every_generation_api() -> None:
    """The api label's values, as kvtax_api_delivered_tokens_total's help lists them (and so
    docs/metrics.md), are the dialects' names: an API added is an API named."""
    from kvtax.delivery.dialects import APIS

    spec = catalog.METRICS["kvtax_api_delivered_tokens_total"]
    named = spec.help.split("kvtax.delivery.dialects: ", 1)[1].split(")", 1)[0]
    assert [name.strip() for name in named.split(",")] == list(APIS)
