"""Renamed settings: the gate's old ``admission.*`` spellings (flag, variable, YAML key) still
set the ``gate.*`` settings, each with one warning naming the new spelling; the new one wins
when a source gives both; ``--help`` hides the old ones and the docs list them once."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvtax import cli
from kvtax.cli.main import build_parser, config_from_args
from kvtax.serve import wiring
from kvtax.serve.config import (
    OPTIONS,
    RENAMED,
    RENAMED_KEYS,
    Config,
    ConfigError,
    load_config,
    render_markdown,
    unknown_env,
)


def _flags(*flags: str) -> tuple[Config, list[str]]:
    warnings: list[str] = []
    config = config_from_args(build_parser().parse_args(["serve", *flags]), {}, warnings)
    return config, warnings


def test_every_gate_setting_has_its_old_admission_name() -> None:
    assert RENAMED == {"admission": "gate"}
    gate = {o.key for o in OPTIONS if o.key.startswith("gate.")}
    assert len(gate) == 14
    assert {o.key for o in RENAMED_KEYS.values()} == gate
    assert {old: o.key for old, o in RENAMED_KEYS.items()}["admission.max_queue"] == (
        "gate.max_queue"
    )
    # No setting is left under the old name.
    assert not [o.key for o in OPTIONS if o.key.startswith("admission.")]


# -- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--admission.max-queue=7", "--admission.max_queue=7"])
def test_an_old_flag_sets_the_gate_setting_with_one_warning(flag: str) -> None:
    config, warnings = _flags(flag, "--admission.mode", "static")
    assert config.gate_max_queue == 7
    assert config.gate_mode == "static"
    assert warnings == [
        "--admission.mode is deprecated: use --gate.mode",
        "--admission.max-queue is deprecated: use --gate.max-queue",
    ]


def test_the_new_flag_wins_over_the_old_one_and_the_warning_says_so() -> None:
    config, warnings = _flags("--admission.mode=static", "--gate.mode=budget")
    assert config.gate_mode == "budget"
    assert warnings == [
        "--admission.mode is ignored: it is the deprecated name of --gate.mode, "
        "which is given too and wins"
    ]


def test_the_new_flags_warn_about_nothing() -> None:
    config, warnings = _flags("--gate.mode=auto", "--gate.floor=4")
    assert (config.gate_mode, config.gate_floor, warnings) == ("auto", 4, [])


def test_an_old_flag_keeps_the_flags_precedence_over_the_environment() -> None:
    warnings: list[str] = []
    args = build_parser().parse_args(["serve", "--admission.floor=5"])
    config = config_from_args(args, {"KVTAX_GATE_FLOOR": "3"}, warnings)
    assert config.gate_floor == 5
    assert warnings == ["--admission.floor is deprecated: use --gate.floor"]


def test_an_old_flag_is_checked_like_the_new_one() -> None:
    with pytest.raises(ConfigError, match=r"--gate\.floor=9 is invalid: must not exceed"):
        _flags("--admission.floor=9", "--admission.ceiling=8")


def test_help_hides_the_old_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--gate.max-queue" in shown
    assert "--admission" not in shown
    assert "KVTAX_ADMISSION" not in shown


# -- environment ----------------------------------------------------------------------------


def test_an_old_variable_sets_the_gate_setting_with_one_warning() -> None:
    warnings: list[str] = []
    env = {"KVTAX_ADMISSION_MODE": "adaptive", "KVTAX_ADMISSION_MAX_WAIT": "5s"}
    config = load_config({}, env=env, file=None, warnings=warnings)
    assert (config.gate_mode, config.gate_max_wait) == ("adaptive", 5.0)
    assert warnings == [
        "environment variable KVTAX_ADMISSION_MODE is deprecated: use KVTAX_GATE_MODE",
        "environment variable KVTAX_ADMISSION_MAX_WAIT is deprecated: use KVTAX_GATE_MAX_WAIT",
    ]
    # load_config warns about it: the unknown-variable check does not add a second warning.
    assert unknown_env(env) == []


def test_the_new_variable_wins_over_the_old_one() -> None:
    warnings: list[str] = []
    env = {"KVTAX_ADMISSION_ORDER": "shortest", "KVTAX_GATE_ORDER": "fifo"}
    assert load_config({}, env=env, file=None, warnings=warnings).gate_order == "fifo"
    assert warnings == [
        "environment variable KVTAX_ADMISSION_ORDER is ignored: it is the deprecated name of "
        "KVTAX_GATE_ORDER, which is given too and wins"
    ]


def test_a_misspelled_old_variable_is_still_unknown() -> None:
    [warning] = unknown_env({"KVTAX_ADMISSION_MODDE": "static"})
    assert "KVTAX_ADMISSION_MODDE is not a kvtax setting" in warning


# -- the YAML file --------------------------------------------------------------------------


def test_an_old_yaml_key_sets_the_gate_setting_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "kvtax.yaml"
    path.write_text("admission:\n  floor: 3\n  ceiling: 9\n")
    warnings: list[str] = []
    config = load_config({}, env={}, file=path, warnings=warnings)
    assert (config.gate_floor, config.gate_ceiling) == (3, 9)
    assert warnings == [
        f"config file {path}: key admission.floor is deprecated: use gate.floor",
        f"config file {path}: key admission.ceiling is deprecated: use gate.ceiling",
    ]


def test_the_new_yaml_key_wins_over_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "kvtax.yaml"
    path.write_text("admission: {mode: static}\ngate: {mode: auto}\n")
    warnings: list[str] = []
    assert load_config({}, env={}, file=path, warnings=warnings).gate_mode == "auto"
    [warning] = warnings
    assert "admission.mode is ignored" in warning
    assert "gate.mode, which is given too and wins" in warning


def test_an_unknown_old_yaml_key_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvtax.yaml"
    path.write_text("admission: {modes: static}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'admission\.modes'"):
        load_config({}, env={}, file=path)


# -- serve logs them; the docs list them once -----------------------------------------------


async def _no_serving(config: Config) -> int:
    return 0


def test_serve_logs_one_warning_per_old_spelling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in [n for n in os.environ if n.startswith("KVTAX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVTAX_ADMISSION_BLOCK_SIZE", "128")
    monkeypatch.setattr(wiring, "run", _no_serving)
    with caplog.at_level(logging.WARNING, logger="kvtax"):
        assert cli.main(["serve", "--admission.mode=static"]) == 0
    renamed = [r.getMessage() for r in caplog.records if "admission" in r.getMessage().lower()]
    assert renamed == [
        "--admission.mode is deprecated: use --gate.mode",
        "environment variable KVTAX_ADMISSION_BLOCK_SIZE is deprecated: use KVTAX_GATE_BLOCK_SIZE",
    ]


def test_the_docs_list_the_old_spellings_once_under_renamed_settings() -> None:
    page = render_markdown()
    table, renamed = page.split("## Renamed settings")
    assert "--admission" not in table
    assert "KVTAX_ADMISSION" not in table
    assert renamed.count("`--admission.*`, `KVTAX_ADMISSION_*`, YAML `admission:`") == 1
    assert "`--gate.*`, `KVTAX_GATE_*`, YAML `gate:`" in renamed


def test_the_switch_to_the_python_scan_is_known_and_a_misspelling_of_it_is_not() -> None:
    """KVTAX_NO_EXTENSIONS is read by kvtax.delivery.eventscan, not by the settings: kvtax must
    not call it ignored."""
    assert unknown_env({"KVTAX_NO_EXTENSIONS": "1"}) == []
    [warning] = unknown_env({"KVTAX_NO_EXTENSION": "1"})
    assert "KVTAX_NO_EXTENSION is not a kvtax setting" in warning
