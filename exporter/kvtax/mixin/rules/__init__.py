"""Prometheus rules and Alertmanager config for kvtax, generated from one config object.

:mod:`.config` holds the knobs, :mod:`.recording` the recording rules the dashboards build on,
:mod:`.alerts` the alert rules, :mod:`.alertmanager` the example routing, and :mod:`.render`
turns them into the committed YAML under ``alerts/`` (``kvtax rules`` writes or checks it).
"""

from kvtax.mixin.rules.config import DEFAULT, FLEET, POD, TEST_PROFILE, RulesConfig, short_profile
from kvtax.mixin.rules.recording import RecordingRule, fleet, per_pod, record_names, recording_rules

__all__ = [
    "DEFAULT",
    "FLEET",
    "POD",
    "TEST_PROFILE",
    "RecordingRule",
    "RulesConfig",
    "fleet",
    "per_pod",
    "record_names",
    "recording_rules",
    "short_profile",
]
