"""docs/package-map.md draws the package's layers; the import contracts in pyproject.toml enforce
them. The drawing must name the same layers, in the same order, and every path it names must
exist, so the newcomer's map cannot drift from the code. The README, the first page anyone
reads, is held to the same: every path it names exists, and every page and section it links
to."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "package-map.md"


def _drawn_layers() -> list[str]:
    text = MAP.read_text()
    block = text.split("## The layers", 1)[1].split("```", 2)[1]
    # Each line: the layer (one module, or siblings joined by " | "), then two or more spaces.
    return [re.split(r"\s{2,}", line.strip())[0] for line in block.strip().splitlines()]


def _contract_layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            layers: list[str] = contract["layers"]
            return layers
    raise AssertionError("no layers contract in pyproject.toml")


def test_the_drawing_names_the_contract_s_layers_in_order() -> None:
    assert _drawn_layers() == _contract_layers()


def test_every_path_the_map_names_exists() -> None:
    package = ROOT / "exporter" / "kvtax"
    named = set(
        re.findall(
            r"`((?:serve|engine|delivery|figures|expose|mixin|tools|cli|gate)"
            r"/[\w/]*(?:\.py)?)`",
            MAP.read_text(),
        )
    )
    named |= set(re.findall(r"^(serve/[\w/]+(?:\.py)?)", MAP.read_text(), re.M))
    assert named, "the map names no path"
    missing = sorted(p for p in named if not (package / p).exists())
    assert missing == []


README = ROOT / "README.md"
# A path in the README starts at one of the checkout's folders or at one of the package's
# (kvtax/..., mixin/..., serve/...), and is resolved from the checkout, from exporter/ or from
# exporter/kvtax/, the three places the README speaks from.
_README_PATH = re.compile(
    r"(?<![\w./-])((?:\.ci|alerts|bench|dashboards|deploy|docs|exporter|scripts|tests|kvtax|kvtax_dev|"
    r"mixin|tools|serve|engine|delivery|figures|expose|gate|cli)/[\w./-]*)"
)


def _exists(path: str) -> bool:
    path = path.rstrip(".")  # a path that ends a sentence
    return any(
        (base / path).exists() for base in (ROOT, ROOT / "exporter", ROOT / "exporter/kvtax")
    )


def test_every_path_the_readme_names_exists() -> None:
    named = set(_README_PATH.findall(README.read_text()))
    assert len(named) > 20, sorted(named)
    assert sorted(p for p in named if not _exists(p)) == []


def test_the_readme_path_check_catches_a_moved_module() -> None:
    # The paths the README named before the restructure into mixin/ and tools/.
    for moved in ("kvtax/rules", "kvtax/loadtest", "kvtax/plan"):
        assert moved in _README_PATH.findall(f"`{moved}` holds it")
        assert not _exists(moved)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


def test_every_page_and_section_the_readme_links_exists() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if not link.startswith(("http://", "https://", "#"))]
    assert len(local) > 15
    broken = []
    for link in local:
        target, _, anchor = link.partition("#")
        page = ROOT / target
        if not page.exists() or (anchor and anchor not in _anchors(page)):
            broken.append(link)
    assert broken == []
