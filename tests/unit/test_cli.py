"""The kvtax command line: bad configuration exits 2 naming the key; docs --check detects drift;
commands of the development harness say how to get a checkout when there is none."""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtax.cli.checkout import DEV_PACKAGE, harness_missing
from kvtax.cli.generated import write_or_check
from kvtax.cli.main import build_parser, main


@pytest.fixture(autouse=True)
def _no_kvtax_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings from the developer's shell must not leak into what these tests check.
    for name in list(os.environ):
        if name.startswith("KVTAX_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("argv", "key", "value"),
    [
        (["serve", "--scrape.interval=-1"], "--scrape.interval", "-1"),
        (["serve", "--vllm.url", "localhost:8000"], "--vllm.url", "localhost:8000"),
        (["serve", "--scrape.interval=5s", "--scrape.timeout=6s"], "--scrape.timeout", "6"),
        (["serve", "--web.listen-address=nowhere"], "--web.listen-address", "nowhere"),
        # The underscore spelling of a flag is accepted too.
        (["serve", "--web.listen_address=nowhere"], "--web.listen-address", "nowhere"),
    ],
)
def test_bad_value_exits_2_naming_key_and_value(
    argv: list[str], key: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtax serve: ")
    assert err.count("\n") == 1
    assert key in err
    assert value in err


def test_bad_env_value_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTAX_SCRAPE_INTERVAL", "-1")
    assert main(["serve"]) == 2
    assert "KVTAX_SCRAPE_INTERVAL='-1'" in capsys.readouterr().err


def test_config_file_with_an_unknown_key_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvtax.yaml"
    path.write_text("scrape:\n  intervl: 5s\n")
    assert main(["serve", "--config.file", str(path)]) == 2
    assert "scrape.intervl" in capsys.readouterr().err


def test_config_file_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvtax.yaml"
    path.write_text("vllm:\n  url: not-a-url\n")
    monkeypatch.setenv("KVTAX_CONFIG_FILE", str(path))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "vllm.url" in err
    assert "not-a-url" in err


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_unknown_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--scrape.intervall=5"])
    assert exit_info.value.code == 2
    assert "--scrape.intervall" in capsys.readouterr().err


def test_every_option_is_a_serve_flag() -> None:
    from kvtax.serve.config import OPTIONS

    parser = build_parser()
    for option in OPTIONS:
        args = parser.parse_args(["serve", f"{option.flag}=x"])
        assert getattr(args, option.key) == "x"


def test_docs_check_fails_on_drift_and_passes_after_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "docs"
    assert main(["docs", "--out", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["docs", "--out", str(out)]) == 0
    assert (out / "metrics.md").read_text().startswith("#")
    assert main(["docs", "--out", str(out), "--check"]) == 0
    (out / "configuration.md").write_text("stale\n")
    assert main(["docs", "--out", str(out), "--check"]) == 1


def test_installed_console_script_exits_2_on_a_bad_interval() -> None:
    script = Path(sys.executable).parent / "kvtax"
    assert script.exists(), "kvtax is not installed in this environment (pip install -e .)"
    env = {"PATH": str(script.parent), "HOME": str(Path.home())}
    done = subprocess.run(
        [str(script), "serve", "--scrape.interval=-1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "--scrape.interval" in done.stderr
    assert "'-1'" in done.stderr
    assert done.stdout == ""


# -- commands that need the development harness (exporter/kvtax_dev, a checkout only) --------


class _NoHarness(importlib.abc.MetaPathFinder):
    """Makes ``import kvtax_dev`` fail the way it does where only the wheel is installed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == DEV_PACKAGE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.fixture
def installed_without_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forget the harness modules this session already imported (restored afterwards), so the
    # command's lazy import really goes looking for the package.
    for name in [m for m in sys.modules if m == DEV_PACKAGE or m.startswith(DEV_PACKAGE + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoHarness(), *sys.meta_path])


@pytest.mark.usefixtures("installed_without_checkout")
def test_demo_without_a_checkout_says_how_to_run_it_and_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--short"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtax demo: this runs from a checkout of the kvtax repository")
    assert "Clone the repository" in err
    assert err.rstrip().endswith("scripts/demo")
    assert "Traceback" not in err


@pytest.mark.usefixtures("installed_without_checkout")
def test_preview_without_a_checkout_says_how_to_run_it_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["dashboards", "preview", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtax dashboards preview: this runs from a checkout")
    assert "PYTHONPATH=exporter kvtax dashboards preview" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.usefixtures("installed_without_checkout")
def test_demo_help_works_without_a_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--help"])
    assert exited.value.code == 0
    assert "scripts/demo" in capsys.readouterr().out


def test_a_module_missing_inside_a_checkout_is_not_reported_as_a_missing_checkout() -> None:
    # A broken dev environment (say aiohttp absent) must show its own error, not "clone the repo".
    assert harness_missing(ModuleNotFoundError("No module named 'kvtax_dev'", name="kvtax_dev"))
    assert not harness_missing(ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp"))
    assert not harness_missing(ModuleNotFoundError("halted", name="kvtax_dev.demo"))


# -- the one --check of every generator (kvtax.cli.generated) -------------------------------------


def test_write_or_check_writes_files_into_new_subfolders(tmp_path: Path) -> None:
    files = {"a.md": "one\n", "nested/b.yaml": "two\n"}
    assert write_or_check(files, tmp_path / "out", check=False, command="kvtax x") == 0
    assert (tmp_path / "out" / "nested" / "b.yaml").read_text() == "two\n"
    assert write_or_check(files, tmp_path / "out", check=True, command="kvtax x") == 0


def test_check_names_each_stale_file_and_the_fix_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {"same.md": "same\n", "edited.md": "new\n", "missing.md": "new\n"}
    (tmp_path / "same.md").write_text("same\n")
    (tmp_path / "edited.md").write_text("old\n")
    code = write_or_check(files, tmp_path, check=True, command="kvtax x", fix="kvtax x generate")
    assert code == 1
    assert capsys.readouterr().err == (
        f"kvtax x: out of date: {tmp_path / 'edited.md'}, {tmp_path / 'missing.md'}; "
        "run `kvtax x generate`\n"
    )
    assert (tmp_path / "edited.md").read_text() == "old\n"
    assert not (tmp_path / "missing.md").exists()


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["docs"], "kvtax docs"),
        (["rules"], "kvtax rules"),
        (["dashboards", "generate"], "kvtax dashboards generate"),
    ],
)
def test_every_generator_checks_through_the_one_check(
    argv: list[str], fix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvtax {argv[0]}: out of date: {tmp_path}")
    assert err.endswith(f"; run `{fix}`\n")
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert main([*argv, "--out", str(tmp_path), "--check"]) == 0
    assert capsys.readouterr().err == ""
