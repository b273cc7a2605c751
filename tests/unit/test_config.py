"""Configuration: flags > env > YAML > defaults, validated once; errors name key and value."""

from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from kvtax.cli.main import build_parser
from kvtax.errors import ConfigError
from kvtax.serve.config import (
    OPTIONS,
    Config,
    Option,
    env_name,
    load_config,
    options,
    parse_address,
    parse_duration,
)

URL = {"vllm.url": "http://127.0.0.1:8000"}


def yaml_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtax.yaml"
    path.write_text(text)
    return path


def test_runs_with_nothing_set_but_the_vllm_url() -> None:
    cfg = load_config({"vllm.url": "http://10.0.0.5:8000/"}, env={}, file=None)
    assert cfg.vllm_url == "http://10.0.0.5:8000"
    assert cfg.scrape_interval == 5.0
    assert cfg.effective_timeout == pytest.approx(4.0)
    assert cfg.window == 300.0
    assert cfg.target_usage == 0.9
    assert cfg.max_num_seqs is None
    assert cfg.web_listen_address == ("0.0.0.0", 10059)


def test_with_nothing_at_all_the_defaults_hold() -> None:
    cfg = load_config({}, env={}, file=None)
    assert cfg.vllm_url == "http://127.0.0.1:8000"


def test_precedence_flags_then_env_then_yaml_then_defaults(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "scrape:\n  interval: 7s\nwindow: 10m\ntarget_usage: 0.8\n")
    env = {"KVTAX_SCRAPE_INTERVAL": "3s", "KVTAX_WINDOW": "15m"}
    flags = {**URL, "scrape.interval": "2s"}
    cfg = load_config(flags, env=env, file=path)
    assert cfg.scrape_interval == 2.0  # flag beats env and YAML
    assert cfg.window == 900.0  # env beats YAML
    assert cfg.target_usage == 0.8  # YAML beats the default
    assert cfg.slo_ttft == 2.0  # default

    cfg = load_config(URL, env=env, file=path)
    assert cfg.scrape_interval == 3.0
    cfg = load_config(URL, env={}, file=path)
    assert cfg.scrape_interval == 7.0
    assert cfg.window == 600.0


def test_a_flag_set_to_none_falls_through_to_the_next_source() -> None:
    cfg = load_config(
        {**URL, "scrape.interval": None}, env={"KVTAX_SCRAPE_INTERVAL": "4"}, file=None
    )
    assert cfg.scrape_interval == 4.0


def test_env_names() -> None:
    assert env_name("scrape.interval") == "KVTAX_SCRAPE_INTERVAL"
    assert env_name("web.listen_address") == "KVTAX_WEB_LISTEN_ADDRESS"


@pytest.mark.parametrize(
    ("flags", "key", "value"),
    [
        ({"scrape.interval": "-1"}, "--scrape.interval", "-1"),
        ({"scrape.interval": "0"}, "--scrape.interval", "0"),
        ({"scrape.interval": "soon"}, "--scrape.interval", "soon"),
        ({"vllm.url": "localhost:8000"}, "--vllm.url", "localhost:8000"),
        ({"vllm.url": "not a url"}, "--vllm.url", "not a url"),
        ({"vllm.url": "ftp://host/"}, "--vllm.url", "ftp://host/"),
        ({"target_usage": "1.5"}, "target", "1.5"),
        ({"max_num_seqs": "-4"}, "max", "-4"),
        ({"web.listen_address": "nope"}, "--web.listen-address", "nope"),
        ({"log.level": "loud"}, "--log.level", "loud"),
    ],
)
def test_bad_flag_values_name_the_key_and_the_value(
    flags: dict[str, str], key: str, value: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(flags, env={}, file=None)
    message = str(err.value)
    assert key in message
    assert repr(value) in message


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"KVTAX_SCRAPE_INTERVAL='-1'"):
        load_config(URL, env={"KVTAX_SCRAPE_INTERVAL": "-1"}, file=None)


def test_bad_yaml_value_names_the_file_and_key(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "scrape:\n  interval: -1\n")
    with pytest.raises(ConfigError) as err:
        load_config(URL, env={}, file=path)
    assert str(path) in str(err.value)
    assert "scrape.interval" in str(err.value)
    assert "-1" in str(err.value)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"scrape.interval": "5s", "scrape.timeout": "5s"}, ("timeout", "5.0", "interval")),
        ({"scrape.interval": "5s", "scrape.timeout": "9s"}, ("timeout", "9.0", "interval")),
        ({"scrape.interval": "5s", "window": "8s"}, ("window", "8.0")),
        ({"gate.fair_reserve": "true"}, ("--gate.fair-reserve", "--gate.fairness-header")),
    ],
)
def test_cross_field_checks(flags: dict[str, str], words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({**URL, **flags}, env={}, file=None)
    for word in words:
        assert word in str(err.value)


def test_timeout_below_the_interval_is_accepted() -> None:
    cfg = load_config(
        {**URL, "scrape.interval": "5s", "scrape.timeout": "4500ms"}, env={}, file=None
    )
    assert cfg.effective_timeout == 4.5


def test_unknown_yaml_key_is_named(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "scrape:\n  intervall: 5s\n")
    with pytest.raises(ConfigError, match=r"unknown key 'scrape.intervall'"):
        load_config(URL, env={}, file=path)


@pytest.mark.parametrize("text", ["scrape: [unclosed\n", "scrape:\n\tinterval: 5\n"])
def test_invalid_yaml_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = yaml_file(tmp_path, text)
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(URL, env={}, file=path)


def test_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(URL, env={}, file=path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(URL, env={}, file=tmp_path / "absent.yaml")


def test_empty_yaml_is_all_defaults(tmp_path: Path) -> None:
    cfg = load_config(URL, env={}, file=yaml_file(tmp_path, ""))
    assert cfg == load_config(URL, env={}, file=None)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5", 5.0), ("2.5s", 2.5), ("500ms", 0.5), ("5m", 300.0), ("1h", 3600.0), (7, 7.0)],
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5 minutes", "", "1d", True])
def test_bad_durations(text: str | bool) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "address"),
    [(":10059", ("0.0.0.0", 10059)), ("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9", ("::1", 9))],
)
def test_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["10059", "host:", "host:0", "host:70000", "host:http"])
def test_bad_addresses(text: str) -> None:
    with pytest.raises(ValueError, match="port"):
        parse_address(text)


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.scrape_interval = 1.0  # type: ignore[misc]


def test_every_default_is_valid() -> None:
    for option in OPTIONS:
        if option.default is not None:
            option.parse(option.default)


# -- one table: each default is written once, and every place that shows it agrees ----------

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_field_is_an_option_of_the_table() -> None:
    assert [o.field for o in OPTIONS] == [f.name for f in fields(Config)]


def test_no_config_field_writes_its_default_outside_the_table() -> None:
    # A literal default on a field (`window: float = 300.0`) would be a second copy of the
    # table's default: every field must be declared by option(), which holds the only one.
    tree = ast.parse(inspect.getsource(options))
    config_class = next(
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Config"
    )
    declared = [node for node in config_class.body if isinstance(node, ast.AnnAssign)]
    assert len(declared) == len(OPTIONS)
    for node in declared:
        call = node.value
        assert isinstance(call, ast.Call), ast.unparse(node)
        assert isinstance(call.func, ast.Name), ast.unparse(node)
        assert call.func.id == "option", ast.unparse(node)


def test_argparse_holds_no_default_of_its_own() -> None:
    # A flag not given must fall through to the environment, the file, then Config's default.
    args = build_parser().parse_args(["serve"])
    assert all(getattr(args, option.key) is None for option in OPTIONS)


def _serve_help() -> dict[str, str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return {action.dest: action.help or "" for action in serve._actions}


def _docs_rows() -> dict[str, str]:
    rows = {}
    for line in (ROOT / "docs/configuration.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`--"):
            rows[cells[0].strip("`")] = cells[2]
    return rows


@pytest.mark.parametrize("setting", OPTIONS, ids=lambda o: o.key)
def test_a_default_is_the_same_in_the_table_config_help_and_docs(setting: Option) -> None:
    typed = None if setting.default is None else setting.parse(setting.default)
    assert getattr(Config(), setting.field) == typed
    assert getattr(load_config({}, env={}, file=None), setting.field) == typed
    shown = "unset" if setting.default is None else str(setting.default)
    assert f"default: {shown})" in _serve_help()[setting.key].replace("%%", "%")
    assert _docs_rows()[setting.flag] == ("unset" if setting.default is None else f"`{shown}`")


def test_a_field_declared_without_option_is_refused() -> None:
    @dataclass(frozen=True)
    class Loose:
        window: float = options.option("window", 300.0, parse_duration, "Window.")
        timeout: float = 5.0

    with pytest.raises(TypeError, match=r"Loose\.timeout is not declared with option\(\)"):
        options.options_of(Loose)


def test_a_field_under_another_options_key_is_refused() -> None:
    @dataclass(frozen=True)
    class Crossed:
        window: float = options.option("scrape.interval", 5.0, parse_duration, "Interval.")

    with pytest.raises(TypeError, match=r"Crossed\.window is declared as 'scrape\.interval'"):
        options.options_of(Crossed)


def test_an_invalid_default_fails_when_the_table_is_defined() -> None:
    with pytest.raises(ValueError, match="duration"):
        options.option("window", "soon", parse_duration, "Window.")


@pytest.mark.parametrize(
    "path", ["metrics", "/healthz", "/readyz", "/", "/a b", "/api/v1/delivered"]
)
def test_a_telemetry_path_that_is_not_a_free_absolute_path_is_refused(path: str) -> None:
    with pytest.raises(ConfigError, match=r"--web\.telemetry-path"):
        load_config({"web.telemetry_path": path}, env={}, file=None)


def test_the_telemetry_path_defaults_to_metrics() -> None:
    assert load_config({}, env={}, file=None).web_telemetry_path == "/metrics"
