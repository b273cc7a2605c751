"""Typed, frozen configuration, validated once at start.

One table, :data:`OPTIONS`, defines every setting: its dotted key, type, default, help and check.
From it come the ``kvtax serve`` flags (``--scrape.interval``), the environment variables
(``KVTAX_SCRAPE_INTERVAL``), the YAML keys (``scrape: {interval: 5s}``) and
``docs/configuration.md``. Precedence: flags, then environment, then the YAML file, then defaults.
A bad value raises :class:`ConfigError` naming the key, where it came from, and the value.

Example::

    cfg = load_config({"vllm.url": "http://127.0.0.1:8000"}, env={}, file=None)
    cfg.scrape_interval  # 5.0
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = [
    "OPTIONS",
    "Config",
    "ConfigError",
    "Option",
    "env_name",
    "load_config",
    "parse_address",
    "parse_duration",
    "render_markdown",
    "unknown_env",
]


class ConfigError(ValueError):
    """A setting is invalid; the message names the key, its source and the bad value."""


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``5``, ``2.5s``, ``500ms``, ``5m`` or ``1h``."""
    if isinstance(text, bool):
        raise ValueError("expected a duration such as 5s, 500ms or 5m")
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(text)
    if not match:
        raise ValueError("expected a duration such as 5s, 500ms or 5m")
    return float(match.group(1)) * _UNIT[match.group(2)]


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``:port`` (all interfaces) into a (host, port) pair."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected host:port or :port with a port in 1-65535")
    return (host.strip("[]") or "0.0.0.0", int(port))


def _url(text: str) -> str:
    parts = urlsplit(str(text))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected an http:// or https:// URL")
    return str(text).rstrip("/")


def _positive(kind: Callable[[Any], float]) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        number = kind(value)
        if not number > 0:
            raise ValueError("must be greater than 0")
        return number

    return check


def _fraction(value: Any) -> float:
    number = float(value)
    if not 0 < number <= 1:
        raise ValueError("must be in (0, 1]")
    return number


def _optional_positive_int(value: Any) -> int | None:
    if value in (None, "", "none"):
        return None
    number = int(value)
    if number <= 0:
        raise ValueError("must be a positive integer")
    return number


def _optional_address(value: Any) -> tuple[str, int] | None:
    if value in (None, "", "off", "none", False):
        return None
    return parse_address(str(value))


def _optional_url(value: Any) -> str | None:
    if value in (None, ""):
        return None
    return _url(value)


def _text(value: Any) -> str:
    return str(value)


_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNIT = {
    None: 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}


def _size(value: Any) -> int:
    match = _SIZE.match(str(value))
    if not match or int(match.group(1)) <= 0:
        raise ValueError("expected a positive size such as 1048576, 512KiB or 32MiB")
    return int(match.group(1)) * _SIZE_UNIT[match.group(2)]


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _optional_path(value: Any) -> Path | None:
    return None if value in (None, "") else Path(str(value))


def _token(value: Any) -> str | None:
    text = "" if value is None else str(value).strip()
    if not text:
        return None
    # It travels in an Authorization header, so it must be a single run of visible ASCII.
    if not all("!" <= char <= "~" for char in text):
        raise ValueError("a token must be visible ASCII without spaces (value not shown)")
    return text


def _selector(value: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), str(v)) for k, v in value.items()))
    pairs = []
    for part in str(value or "").split(","):
        if not part.strip():
            continue
        name, sep, wanted = part.partition("=")
        if not sep or not name.strip():
            raise ValueError("expected label=value pairs separated by commas")
        pairs.append((name.strip(), wanted.strip().strip('"')))
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class Option:
    """One setting. ``key`` is dotted; the Config field is the key with dots as underscores."""

    key: str
    default: Any
    parse: Callable[[Any], Any]
    help: str
    metavar: str = "VALUE"
    # A secret's value never appears in an error message (or anywhere else kvtax prints).
    secret: bool = False

    @property
    def switch(self) -> bool:
        """A true/false setting: its flag may be given bare, meaning true."""
        return self.metavar == "BOOL"

    @property
    def field(self) -> str:
        return self.key.replace(".", "_")

    @property
    def flag(self) -> str:
        """The command-line flag: ``--web.listen-address`` for ``web.listen_address``."""
        return "--" + self.key.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option(
        "vllm.url",
        "http://127.0.0.1:8000",
        _url,
        "Base URL of the vLLM server; kvtax scrapes <url>/metrics.",
        "URL",
    ),
    Option(
        "scrape.interval", 5.0, _positive(parse_duration), "How often to scrape vLLM.", "DURATION"
    ),
    Option(
        "scrape.timeout",
        None,
        lambda v: None if v in (None, "") else _positive(parse_duration)(v),
        "Scrape timeout; defaults to 80% of the interval and must be below it.",
        "DURATION",
    ),
    Option(
        "scrape.max_bytes",
        "8MiB",
        _size,
        "Largest /metrics page read from vLLM; reading stops and the scrape fails (too_large) "
        "once a page passes it. One model's page is about 50KiB.",
        "BYTES",
    ),
    Option(
        "scrape.max_series",
        50_000,
        _positive(int),
        "Most series a vLLM page may carry; a page with more fails (too_many_series) before "
        "it is parsed. One model's page has about 450.",
        "N",
    ),
    Option(
        "scrape.max_models",
        32,
        _positive(int),
        "Most model_name values kvtax tracks from vLLM's page; more are left out and counted "
        "in kvtax_scrape_dropped_models_total.",
        "N",
    ),
    Option(
        "web.listen_address",
        ":9464",
        parse_address,
        "Where kvtax serves /metrics, /healthz and /readyz.",
        "HOST:PORT",
    ),
    Option(
        "window",
        300.0,
        _positive(parse_duration),
        "Window of the rate and ratio gauges.",
        "DURATION",
    ),
    Option(
        "target_usage",
        0.9,
        _fraction,
        "KV usage the recommended max_num_seqs aims for, 0-1.",
        "RATIO",
    ),
    Option(
        "max_num_seqs",
        None,
        _optional_positive_int,
        "The --max-num-seqs vLLM runs with, to publish the over-admission ratio.",
        "N",
    ),
    Option(
        "proxy.listen_address",
        ":8001",
        _optional_address,
        "Where the OpenAI-compatible proxy in front of vLLM listens; off turns it off.",
        "HOST:PORT",
    ),
    Option(
        "proxy.max_body",
        "4MiB",
        _size,
        "Largest request body the proxy accepts, with or without Content-Length; larger ones "
        "get 413. Completion bodies are held whole (to read the model and ask for usage), so "
        "this bounds memory per request: a 128k-token prompt is about 0.5 MiB.",
        "BYTES",
    ),
    Option(
        "proxy.timeout",
        300.0,
        _positive(parse_duration),
        "Longest wait for vLLM's response headers, or for the next chunk of a response.",
        "DURATION",
    ),
    Option(
        "proxy.stall_factor",
        5.0,
        _positive(float),
        "A gap between stream chunks this many times the stream's median gap is a stall.",
        "RATIO",
    ),
    Option(
        "proxy.stall_min",
        0.05,
        _positive(parse_duration),
        "No gap shorter than this counts as a stall, however small the median.",
        "DURATION",
    ),
    Option(
        "push.token",
        None,
        _token,
        "Bearer token the delivered-tokens push endpoint requires. Without a token (here or "
        "in --push.token-file) push is refused, unless --push.allow-unauthenticated is given.",
        "TOKEN",
        secret=True,
    ),
    Option(
        "push.token_file",
        None,
        _optional_path,
        "File holding the push token, e.g. a mounted Kubernetes Secret; read once at start, "
        "surrounding whitespace ignored. Use instead of --push.token, which shows in ps.",
        "PATH",
    ),
    Option(
        "push.allow_unauthenticated",
        "false",
        _boolean,
        "Accept pushes without a token from anyone who can reach the web port; "
        "ignored when a token is set.",
        "BOOL",
    ),
    Option(
        "gateway.url",
        None,
        _optional_url,
        "A gateway's Prometheus endpoint to read delivered tokens from (e.g. LiteLLM's).",
        "URL",
    ),
    Option(
        "gateway.metric",
        "litellm_output_tokens_metric_total",
        _text,
        "The gateway's delivered-tokens counter (a histogram's _sum is used for histograms).",
        "NAME",
    ),
    Option(
        "gateway.model_label",
        "model",
        _text,
        "The gateway metric's label that holds the model name.",
        "LABEL",
    ),
    Option(
        "gateway.selector",
        "",
        _selector,
        "Extra label matches for the gateway metric, e.g. gen_ai_token_type=output.",
        "LABEL=VALUE,...",
    ),
    Option(
        "slo.ttft",
        2.0,
        _positive(parse_duration),
        "Time-to-first-token SLO for SLO goodput.",
        "DURATION",
    ),
    Option(
        "slo.itl",
        0.2,
        _positive(parse_duration),
        "Inter-token latency SLO (every gap) for SLO goodput.",
        "DURATION",
    ),
    Option(
        "shutdown.grace_period",
        30.0,
        lambda v: _nonnegative(parse_duration(v)),
        "On SIGTERM, how long requests in flight may finish before the rest are ended; "
        "keep it below the pod's terminationGracePeriodSeconds.",
        "DURATION",
    ),
    Option(
        "log.level",
        "info",
        lambda v: _choice(v, ("debug", "info", "warning", "error")),
        "Log level: debug, info, warning or error.",
        "LEVEL",
    ),
)


def _nonnegative(number: float) -> float:
    if number < 0:
        raise ValueError("must not be negative")
    return number


def _choice(value: Any, choices: tuple[str, ...]) -> str:
    text = str(value).lower()
    if text not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return text


@dataclass(frozen=True, slots=True)
class Config:
    """Validated settings. Field names are the option keys with dots as underscores."""

    vllm_url: str = "http://127.0.0.1:8000"
    scrape_interval: float = 5.0
    scrape_timeout: float | None = None
    scrape_max_bytes: int = 8 * 1024**2
    scrape_max_series: int = 50_000
    scrape_max_models: int = 32
    web_listen_address: tuple[str, int] = ("0.0.0.0", 9464)
    window: float = 300.0
    target_usage: float = 0.9
    max_num_seqs: int | None = None
    proxy_listen_address: tuple[str, int] | None = ("0.0.0.0", 8001)
    proxy_max_body: int = 4 * 1024**2
    proxy_timeout: float = 300.0
    proxy_stall_factor: float = 5.0
    proxy_stall_min: float = 0.05
    push_token: str | None = field(default=None, repr=False)
    push_token_file: Path | None = None
    push_allow_unauthenticated: bool = False
    gateway_url: str | None = None
    gateway_metric: str = "litellm_output_tokens_metric_total"
    gateway_model_label: str = "model"
    gateway_selector: tuple[tuple[str, str], ...] = ()
    slo_ttft: float = 2.0
    slo_itl: float = 0.2
    shutdown_grace_period: float = 30.0
    log_level: str = "info"

    @property
    def effective_timeout(self) -> float:
        return (
            self.scrape_timeout if self.scrape_timeout is not None else self.scrape_interval * 0.8
        )


def env_name(key: str) -> str:
    return "KVTAX_" + key.replace(".", "_").upper()


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        # Not str(exc): PyYAML quotes the offending line, and it may hold the push token.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"config file {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return _flatten(data)


def load_config(flags: Mapping[str, Any], *, env: Mapping[str, str], file: Path | None) -> Config:
    """Merge flags > environment > YAML file > defaults and validate every value."""
    by_key = {o.key: o for o in OPTIONS}
    from_file = _read_file(file) if file is not None else {}
    for key in from_file:
        if key not in by_key:
            raise ConfigError(f"config file {file}: unknown key {key!r}")
    values: dict[str, Any] = {}
    for option in OPTIONS:
        raw: Any
        if flags.get(option.key) is not None:
            raw, source = flags[option.key], option.flag
        elif env_name(option.key) in env:
            raw, source = env[env_name(option.key)], env_name(option.key)
        elif option.key in from_file:
            raw, source = from_file[option.key], f"{file}: {option.key}"
        else:
            values[option.field] = (
                option.default if option.default is None else option.parse(option.default)
            )
            continue
        try:
            values[option.field] = option.parse(raw)
        except (ValueError, TypeError) as exc:
            shown = "<hidden>" if option.secret else repr(raw)
            raise ConfigError(f"{source}={shown} is invalid: {exc}") from None
    config = _with_token_file(Config(**values))
    if config.effective_timeout >= config.scrape_interval:
        raise ConfigError(
            f"--scrape.timeout={config.scrape_timeout} is invalid: must be below "
            f"--scrape.interval={config.scrape_interval}"
        )
    if config.window < 2 * config.scrape_interval:
        raise ConfigError(
            f"--window={config.window} is invalid: must be at least two scrape intervals "
            f"({2 * config.scrape_interval}s)"
        )
    return config


def _with_token_file(config: Config) -> Config:
    """The config with the push token read from ``--push.token-file``, if one is given."""
    path = config.push_token_file
    if path is None:
        return config
    if config.push_token is not None:
        raise ConfigError(
            f"--push.token-file={str(path)!r} is invalid: --push.token is set too; give one"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"--push.token-file={str(path)!r} is invalid: {reason}") from None
    try:
        token = _token(text)
    except ValueError as exc:
        raise ConfigError(f"--push.token-file={str(path)!r} is invalid: {exc}") from None
    if token is None:
        raise ConfigError(f"--push.token-file={str(path)!r} is invalid: the file is empty")
    return replace(config, push_token=token)


# KVTAX_* variables that are not settings: the repository's own scripts, test suite and
# testbed read them, and they are exported into the environment `kvtax serve` runs in.
_TOOL_VARIABLES = frozenset(
    {
        "KVTAX_ALERTMANAGER_BIN",
        "KVTAX_CACHE",
        "KVTAX_DEV_VENV",
        "KVTAX_PROMETHEUS_BIN",
        "KVTAX_PYTHON",
        "KVTAX_RESULTS_DIR",
        "KVTAX_SAVE_PREVIEW",
        "KVTAX_SKIP_E2E",
        "KVTAX_VLLM_VENV",
    }
)


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``KVTAX_*`` variable that kvtax does not know, naming the closest.

    A warning rather than an error: the project's own tools export KVTAX_* variables of their
    own, a newer manifest may set a variable an older image lacks, and push fails closed, so a
    misspelled token variable leaves push refused, not open.
    """
    settings = sorted({env_name(o.key) for o in OPTIONS} | {"KVTAX_CONFIG_FILE"})
    warnings = []
    for name in sorted(env):
        if not name.startswith("KVTAX_") or name in settings or name in _TOOL_VARIABLES:
            continue
        close = difflib.get_close_matches(name, settings, n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "see docs/configuration.md"
        warnings.append(
            f"environment variable {name} is not a kvtax setting and is ignored; {hint}"
        )
    return warnings


def render_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from :data:`OPTIONS`."""
    lines = [
        "# kvtax configuration reference",
        "",
        "Generated from `exporter/kvtax/serve/config.py` by `kvtax docs`; do not edit by hand.",
        "",
        "Precedence: command-line flag, then environment variable, then the YAML file given by",
        "`--config.file` (nested keys: `scrape: {interval: 5s}`), then the default.",
        "Durations accept `500ms`, `5s`, `5m`, `1h` or plain seconds.",
        "",
        "| flag | environment | default | meaning |",
        "|---|---|---|---|",
    ]
    for o in OPTIONS:
        default = "unset" if o.default is None else f"`{o.default}`"
        lines.append(f"| `{o.flag}` | `{env_name(o.key)}` | {default} | {o.help} |")
    return "\n".join(lines) + "\n"


assert {o.field for o in OPTIONS} == {f.name for f in fields(Config)}, "OPTIONS and Config drift"
