"""``--config FILE.yaml`` refuses numbers and durations no alert can use, naming the key.

NaN, infinities and negative thresholds, shares outside 0 to 1, and durations Prometheus
itself would refuse (longer than int64 nanoseconds, units out of order) stop ``kvtax rules``
and ``kvtax dashboards generate`` with one line and exit 2, as any other bad setting does. The
duration bound is checked against promtool, not restated.
"""

from __future__ import annotations

import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtax.cli.main import main
from kvtax.errors import RulesConfigError
from kvtax.mixin.rules import DEFAULT, RulesConfig
from kvtax.mixin.rules.config import POSITIVE, SHARES, threshold_problem
from kvtax.mixin.rules.configfile import (
    MAX_DURATION,
    MAX_DURATION_MS,
    duration_ms,
    from_mapping,
)
from tests.unit.test_rules_config import promtool

NUMBERS = [f.name for f in fields(RulesConfig) if f.type in (float, "float")]


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"tax_warning": float("nan")}, "tax_warning: expected a finite number, not nan"),
        ({"tax_critical": float("inf")}, "tax_critical: expected a finite number, not inf"),
        ({"slo_ttft_seconds": float("-inf")}, "slo_ttft_seconds: expected a finite number"),
        ({"stalls_per_request": -0.1}, "stalls_per_request: expected a number of 0 or more"),
        ({"shed_per_second": -1}, "shed_per_second: expected a number of 0 or more"),
        ({"tax_warning": -0.05}, "tax_warning: expected a share from 0 to 1, not -0.05"),
        ({"kv_near_full_usage": 85}, "kv_near_full_usage: expected a share from 0 to 1, not 85"),
        ({"slo_ttft_quantile": 99}, "slo_ttft_quantile: expected a share from 0 to 1"),
        ({"gate_shed_ratio": 1.5}, "gate_shed_ratio: expected a share from 0 to 1"),
        ({"slo_ttft_seconds": 0}, "slo_ttft_seconds: expected a number above 0, not 0"),
        ({"over_admission_ratio": 0}, "over_admission_ratio: expected a number above 0"),
        ({"shed_per_second": 10**400}, "shed_per_second: expected a finite number"),
        ({"tax_for": "99999999999999999999y"}, "tax_for: 99999999999999999999y is longer"),
        ({"tax_for": "293y"}, f"at most {MAX_DURATION} (about 292 years"),
        ({"slo_for": "9" * 5000 + "y"}, "slo_for: 999"),
        ({"rate_window": "106752d"}, "rate_window: 106752d is longer than Prometheus can hold"),
        ({"rate_window": "0s"}, "rate_window: a window must be longer than 0"),
        ({"queue_window": "0"}, "queue_window: a window must be longer than 0"),
        ({"tax_for": "30m1h"}, "tax_for: expected a Prometheus duration"),
        ({"tax_for": "5m5m"}, "tax_for: expected a Prometheus duration"),
        ({"tax_for": ""}, "tax_for: expected a Prometheus duration"),
        ({"tax_for": "5m\n"}, "tax_for: expected a Prometheus duration"),
        ({"tax_for": "٣m"}, "tax_for: expected a Prometheus duration"),
    ],
)
def test_nonsense_numbers_and_durations_name_the_key(document: dict[str, Any], named: str) -> None:
    with pytest.raises(RulesConfigError) as caught:
        from_mapping(document, source="rules.yaml")
    message = str(caught.value)
    assert message.startswith("rules.yaml: ")
    assert named in message
    assert "\n" not in message
    assert len(message) < 400


def test_every_default_number_is_in_its_range_and_every_share_is_a_number() -> None:
    for name in NUMBERS:
        assert threshold_problem(name, getattr(DEFAULT, name)) is None, name
    assert set(NUMBERS) >= SHARES
    assert set(NUMBERS) >= POSITIVE
    assert not SHARES & POSITIVE


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tax_critical", 1),
        ("tax_warning", 0),
        ("shed_per_second", 0),
        ("tax_for", "0"),
        ("tax_for", "0s"),
        ("tax_for", "1h30m"),
        ("tax_for", MAX_DURATION),
        ("rate_window", "1ms"),
    ],
)
def test_the_edges_prometheus_accepts_are_accepted(key: str, value: Any) -> None:
    assert getattr(from_mapping({key: value}), key) == value


def test_the_duration_bound_is_prometheus_own(tmp_path: Path) -> None:
    """promtool takes the longest duration kvtax takes, and refuses one millisecond more."""
    assert duration_ms(MAX_DURATION) == MAX_DURATION_MS
    assert MAX_DURATION_MS == (2**63 - 1) // 10**6  # int64 nanoseconds, in milliseconds
    longer = MAX_DURATION.removesuffix("854ms") + "855ms"
    with pytest.raises(ValueError, match="longer than Prometheus can hold"):
        duration_ms(longer)
    results = {}
    for hold in (MAX_DURATION, longer):
        rules = {
            "groups": [{"name": "g", "rules": [{"alert": "A", "expr": "vector(1)", "for": hold}]}]
        }
        path = tmp_path / "rules.yaml"
        path.write_text(yaml.safe_dump(rules))
        check = subprocess.run(
            [promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False
        )
        results[hold] = (check.returncode, check.stdout + check.stderr)
    assert results[MAX_DURATION][0] == 0, results[MAX_DURATION][1]
    assert results[longer][0] != 0
    assert "duration out of range" in results[longer][1]


@pytest.mark.parametrize(
    ("command", "text", "named"),
    [
        (["rules"], "tax_warning: .nan\n", "tax_warning: expected a finite number, not nan"),
        (["rules"], "tax_critical: .inf\n", "tax_critical: expected a finite number, not inf"),
        (["rules"], "thrash_usage: -0.5\n", "thrash_usage: expected a share from 0 to 1"),
        (["rules"], "tax_for: 99999999999999999999y\n", "tax_for: 99999999999999999999y is"),
        (["dashboards", "generate"], "kv_near_full_usage: .nan\n", "kv_near_full_usage: expected"),
        (["dashboards", "generate"], "stalls_per_request: -1\n", "stalls_per_request: expected"),
        (["dashboards", "generate"], "rate_window: 300y\n", "rate_window: 300y is longer"),
    ],
)
def test_both_clis_refuse_a_nonsense_file_with_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    text: str,
    named: str,
) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    assert main([*command, "--config", str(config), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"kvtax {' '.join(command)}: {config}: {named}")
    assert not out.exists()


def test_a_yaml_file_nested_too_deeply_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text("tax_for: " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["rules", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"kvtax rules: {config}: not YAML")
