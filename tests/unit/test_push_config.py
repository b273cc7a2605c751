"""Push secrets in configuration: the token from a file, never shown; unknown KVTAX_* reported."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvtax import cli
from kvtax.errors import ConfigError
from kvtax.serve import wiring
from kvtax.serve.config import Config, load_config, unknown_env

SECRET = "s3cret-Token_42"


def test_the_token_is_read_from_a_file_such_as_a_mounted_secret(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"{SECRET}\n")  # `kubectl create secret --from-file` keeps the newline
    cfg = load_config({}, env={"KVTAX_PUSH_TOKEN_FILE": str(path)}, file=None)
    assert cfg.push_token == SECRET
    assert load_config({"push.token_file": str(path)}, env={}, file=None).push_token == SECRET


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "No such file or directory"),
        ("\n", "the file is empty"),
        ("two words", "visible ASCII without spaces"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_a_bad_token_file_is_a_configuration_error_naming_the_file(
    tmp_path: Path, content: str | bytes | None, reason: str
) -> None:
    path = tmp_path / "token"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=reason) as caught:
        load_config({"push.token_file": str(path)}, env={}, file=None)
    assert f"--push.token-file='{path}'" in str(caught.value)
    assert "two" not in str(caught.value)


def test_a_token_and_a_token_file_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(SECRET)
    with pytest.raises(ConfigError, match=r"--push\.token is set too") as caught:
        load_config({"push.token": "other", "push.token_file": str(path)}, env={}, file=None)
    assert SECRET not in str(caught.value)


def test_a_bad_token_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({}, env={"KVTAX_PUSH_TOKEN": "s3cret with\x01ctl"}, file=None)
    message = str(caught.value)
    assert message.startswith("KVTAX_PUSH_TOKEN=<hidden> is invalid")
    assert "s3cret" not in message


def test_a_yaml_error_does_not_quote_the_line_with_the_token(tmp_path: Path) -> None:
    path = tmp_path / "kvtax.yaml"
    path.write_text(f"push:\n  token: abc: {SECRET}\n")
    with pytest.raises(ConfigError) as caught:
        load_config({}, env={}, file=path)
    message = str(caught.value)
    assert message == (
        f"config file {path}: invalid YAML at line 2, column 13: "
        "mapping values are not allowed here"
    )
    assert caught.value.__cause__ is None


def test_the_token_is_left_out_of_the_config_repr() -> None:
    cfg = load_config({"push.token": SECRET}, env={}, file=None)
    assert cfg.push_token == SECRET
    assert SECRET not in repr(cfg)
    assert "push_token_file=None" in repr(cfg)


def test_push_is_refused_by_default_and_the_switch_can_be_given_bare() -> None:
    assert Config().push_allow_unauthenticated is False
    assert load_config({}, env={}, file=None).push_allow_unauthenticated is False
    args = cli.build_parser().parse_args(["serve", "--push.allow-unauthenticated"])
    assert cli.config_from_args(args, {}).push_allow_unauthenticated is True
    args = cli.build_parser().parse_args(["serve", "--push.allow-unauthenticated=false"])
    assert cli.config_from_args(args, {}).push_allow_unauthenticated is False
    env = {"KVTAX_PUSH_ALLOW_UNAUTHENTICATED": "yes"}
    assert load_config({}, env=env, file=None).push_allow_unauthenticated is True


def test_an_unknown_kvtax_variable_is_reported_with_the_closest_setting() -> None:
    env = {
        "KVTAX_PUSH_TOKN": "x",
        "KVTAX_SCRAPE_INTERVALL": "5s",
        "KVTAX_NOTHING_LIKE_IT": "1",
        "KVTAX_PUSH_TOKEN": SECRET,
        "PATH": "/bin",
    }
    assert unknown_env(env) == [
        "environment variable KVTAX_NOTHING_LIKE_IT is not a kvtax setting and is ignored; "
        "see docs/configuration.md",
        "environment variable KVTAX_PUSH_TOKN is not a kvtax setting and is ignored; "
        "did you mean KVTAX_PUSH_TOKEN?",
        "environment variable KVTAX_SCRAPE_INTERVALL is not a kvtax setting and is ignored; "
        "did you mean KVTAX_SCRAPE_INTERVAL?",
    ]


def test_the_projects_own_variables_are_not_reported() -> None:
    env = {
        "KVTAX_VLLM_VENV": "/v",
        "KVTAX_SKIP_E2E": "1",
        "KVTAX_CACHE": "/c",
        "KVTAX_DEV_VENV": "/d",
        "KVTAX_CONFIG_FILE": "/k.yaml",
        "KVTAX_PROMETHEUS_BIN": "/p",
    }
    assert unknown_env(env) == []


async def _no_serving(config: Config) -> int:
    return 0


def test_serve_warns_about_an_unknown_variable_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in [n for n in os.environ if n.startswith("KVTAX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVTAX_PUSH_TOKN", SECRET)
    monkeypatch.setattr(wiring, "run", _no_serving)
    with caplog.at_level(logging.WARNING, logger="kvtax"):
        assert cli.main(["serve"]) == 0
    [record] = [r for r in caplog.records if "KVTAX_PUSH_TOKN" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "did you mean KVTAX_PUSH_TOKEN?" in record.getMessage()
    assert SECRET not in caplog.text
