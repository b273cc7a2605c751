"""docs/package-map.md draws the package's layers; the import contracts in pyproject.toml enforce
them. The drawing must name the same layers, in the same order, and every path it names must
exist, so the newcomer's map cannot drift from the code."""

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
