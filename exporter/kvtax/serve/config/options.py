"""The options table: every kvtax setting, written once, as the fields of :class:`Config`.

Each field of :class:`Config` is declared with :func:`option`, which holds the setting's dotted
key, its default as a user would write it (``"8MiB"``, ``":10059"``), its parser, help and
metavar. The field's default is that text parsed, so ``Config()``, the ``kvtax serve`` flags and
their ``--help``, the ``KVTAX_*`` environment variables, the YAML keys and
``docs/configuration.md`` all come from this one table and cannot disagree.

Example:

    >>> Config().scrape_interval  # parsed from the table's default, "5s"
    5.0
    >>> next(o for o in OPTIONS if o.key == "window").flag
    '--window'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtax.delivery.adapters import adapter_pairs
from kvtax.serve.config import values as v
from kvtax.serve.config.option import Option, env_name, option, options_of, renamed_keys

__all__ = [
    "OPTIONS",
    "RENAMED",
    "RENAMED_KEYS",
    "Config",
    "Option",
    "env_name",
    "option",
    "options_of",
]


@dataclass(frozen=True, slots=True)
class Config:
    """Validated settings. Field names are the option keys with dots as underscores."""

    vllm_url: str = option(
        "vllm.url",
        "http://127.0.0.1:8000",
        v.url,
        "Base URL of the vLLM server; kvtax scrapes <url>/metrics.",
        "URL",
    )
    scrape_interval: float = option(
        "scrape.interval", 5.0, v.positive_duration, "How often to scrape vLLM.", "DURATION"
    )
    scrape_timeout: float | None = option(
        "scrape.timeout",
        None,
        v.optional_duration,
        "Scrape timeout; defaults to 80% of the interval and must be below it.",
        "DURATION",
    )
    scrape_max_bytes: int = option(
        "scrape.max_bytes",
        "8MiB",
        v.size,
        "Largest /metrics page read from vLLM; reading stops and the scrape fails (too_large) "
        "once a page passes it. One model's page is about 50KiB.",
        "BYTES",
    )
    scrape_max_series: int = option(
        "scrape.max_series",
        50_000,
        v.positive(int),
        "Most series a vLLM page may carry; a page with more fails (too_many_series) before "
        "it is parsed. One model's page has about 450.",
        "N",
    )
    scrape_max_models: int = option(
        "scrape.max_models",
        32,
        v.positive(int),
        "Most model_name values kvtax tracks from vLLM's page; more are left out and counted "
        "in kvtax_scrape_dropped_models_total.",
        "N",
    )
    web_listen_address: tuple[str, int] = option(
        "web.listen_address",
        ":10059",
        v.parse_address,
        "Where kvtax serves /metrics, /healthz and /readyz.",
        "HOST:PORT",
    )
    web_telemetry_path: str = option(
        "web.telemetry_path",
        "/metrics",
        v.telemetry_path,
        "The path of kvtax's metrics page on the web port.",
        "PATH",
    )
    # option() returns a dataclasses.Field, which ruff cannot see; Path | None is immutable.
    web_config_file: Path | None = option(  # noqa: RUF009
        "web.config.file",
        None,
        v.optional_path,
        "Prometheus exporter-toolkit web config (YAML) for TLS and basic auth on the web port: "
        "tls_server_config (cert_file, key_file, client_ca_file, client_auth_type, "
        "min_version, max_version) and basic_auth_users (bcrypt hashes). Basic auth guards "
        "the metrics page, not /healthz, /readyz or the push route (which has its own token).",
        "PATH",
    )
    window: float = option(
        "window", 300.0, v.positive_duration, "Window of the rate and ratio gauges.", "DURATION"
    )
    target_usage: float = option(
        "target_usage",
        0.9,
        v.fraction,
        "KV usage the recommended max_num_seqs aims for, 0-1.",
        "RATIO",
    )
    max_num_seqs: int | None = option(
        "max_num_seqs",
        None,
        v.optional_positive_int,
        "The --max-num-seqs vLLM runs with (its --max-num-active-seqs where set), to publish "
        "the over-admission ratio.",
        "N",
    )
    proxy_listen_address: tuple[str, int] | None = option(
        "proxy.listen_address",
        ":8001",
        v.optional_address,
        "Where the proxy in front of vLLM (on every generation API) listens; off turns it off.",
        "HOST:PORT",
    )
    proxy_workers: int = option(
        "proxy.workers",
        1,
        v.workers,
        "Proxy processes relaying on the proxy port (SO_REUSEPORT), each on a core of its own; "
        "auto: as many as the cores kvtax's CPU limit allows (its cgroup's cpu.max, else the "
        "CPUs it may run on). Above 1, kvtax itself keeps the scrape, /metrics, the one ledger "
        "the workers report to and the one gate they ask. Raise it when the relay's CPU nears "
        "a core per worker under load (the rate of process_cpu_seconds_total, plus "
        "kvtax_proxy_worker_cpu_seconds_total's with workers), and give kvtax's container a "
        "CPU limit of about N cores.",
        "N|auto",
    )
    proxy_max_body: int = option(
        "proxy.max_body",
        "64MiB",
        v.size,
        "Largest body of a request to a generation API (completions, chat, Messages, Responses, "
        "generate...), with or without Content-Length; larger ones get 413. These bodies are "
        "held whole (to read the model and ask for usage), so this bounds memory per request: "
        "a 128k-token prompt is about 0.5 MiB, a chat request with base64 images tens of MiB. "
        "Other paths' bodies, and the audio APIs' uploads (whose form fields are read as they "
        "pass), are streamed to vLLM as they arrive, with no limit of kvtax's own.",
        "BYTES",
    )
    proxy_timeout: float = option(
        "proxy.timeout",
        300.0,
        v.positive_duration,
        "Longest silence of vLLM's: the wait for its response headers, or for its next bytes "
        "while kvtax reads them. Time kvtax holds vLLM paused because the client is slow to "
        "read does not count.",
        "DURATION",
    )
    proxy_send_timeout: float = option(
        "proxy.send_timeout",
        60.0,
        v.positive_duration,
        "Longest a client may leave its socket full (read nothing of its answer) before it "
        "counts as gone: its request is aborted in vLLM (nginx's send_timeout).",
        "DURATION",
    )
    proxy_stall_factor: float = option(
        "proxy.stall_factor",
        5.0,
        v.positive(float),
        "A gap between stream chunks this many times the stream's median gap is a stall.",
        "RATIO",
    )
    proxy_stall_min: float = option(
        "proxy.stall_min",
        0.05,
        v.positive_duration,
        "No gap shorter than this counts as a stall, however small the median.",
        "DURATION",
    )
    push_token: str | None = option(
        "push.token",
        None,
        v.token,
        "Bearer token the delivered-tokens push endpoint requires. Without a token (here or "
        "in --push.token-file) push is refused, unless --push.allow-unauthenticated is given.",
        "TOKEN",
        secret=True,
    )
    # option() returns a dataclasses.Field, which ruff cannot see; Path | None is immutable.
    push_token_file: Path | None = option(  # noqa: RUF009
        "push.token_file",
        None,
        v.optional_path,
        "File holding the push token, e.g. a mounted Kubernetes Secret; read once at start, "
        "surrounding whitespace ignored. Use instead of --push.token, which shows in ps.",
        "PATH",
    )
    push_allow_unauthenticated: bool = option(
        "push.allow_unauthenticated",
        "false",
        v.boolean,
        "Accept pushes without a token from anyone who can reach the web port; "
        "ignored when a token is set.",
        "BOOL",
    )
    gateway_url: str | None = option(
        "gateway.url",
        None,
        v.optional_url,
        "A gateway's Prometheus endpoint to read delivered tokens from (e.g. LiteLLM's).",
        "URL",
    )
    gateway_metric: str = option(
        "gateway.metric",
        "litellm_output_tokens_metric_total",
        v.text,
        "The gateway's delivered-tokens counter (a histogram's _sum is used for histograms).",
        "NAME",
    )
    gateway_model_label: str = option(
        "gateway.model_label",
        "model",
        v.text,
        "The gateway metric's label that holds the model name.",
        "LABEL",
    )
    gateway_selector: tuple[tuple[str, str], ...] = option(
        "gateway.selector",
        "",
        v.selector,
        "Extra label matches for the gateway metric, e.g. gen_ai_token_type=output.",
        "LABEL=VALUE,...",
    )
    delivery_adapters: tuple[tuple[str, str], ...] = option(
        "delivery.adapters",
        "",
        adapter_pairs,
        "LoRA adapters and their base models: a request naming an adapter counts under the "
        "base model, whose engine series did the work. Adds to (and overrides) what vLLM's "
        "/v1/models says.",
        "ADAPTER=BASE,...",
    )
    delivery_models_refresh: float = option(
        "delivery.models_refresh",
        "5m",
        v.nonnegative_duration,
        "How often to read vLLM's /v1/models for LoRA adapters and their parent model; "
        "0 turns it off.",
        "DURATION",
    )
    slo_ttft: float = option(
        "slo.ttft",
        2.0,
        v.positive_duration,
        "Time-to-first-token SLO for SLO goodput.",
        "DURATION",
    )
    slo_itl: float = option(
        "slo.itl",
        0.2,
        v.positive_duration,
        "Inter-token latency SLO (every gap) for SLO goodput.",
        "DURATION",
    )
    shutdown_grace_period: float = option(
        "shutdown.grace_period",
        30.0,
        v.nonnegative_duration,
        "On SIGTERM, how long requests in flight may finish before the rest are ended; "
        "keep it below the pod's terminationGracePeriodSeconds.",
        "DURATION",
    )
    log_level: str = option(
        "log.level",
        "info",
        v.log_level,
        "Log level: debug, info, warning or error.",
        "LEVEL",
    )
    log_format: str = option(
        "log.format",
        "logfmt",
        v.log_format,
        "Log line format: logfmt (key=value pairs) or json (one object per line).",
        "FORMAT",
    )

    # -- the gate (docs/gate.md) ---------------------------------------------------------------
    gate_mode: str = option(
        "gate.mode",
        "off",
        v.one_of("off", "static", "budget", "auto", "adaptive"),
        "The proxy's KV-aware gate: off (relay as is), static (cap requests in flight at "
        "--gate.static-cap), budget (admit by worst-case KV blocks against capacity x "
        "--target-usage), auto (cap at the recommended max_num_seqs, live) or adaptive (AIMD "
        "from preemptions and KV usage between --gate.floor and --gate.ceiling).",
        "MODE",
    )
    gate_static_cap: int = option(
        "gate.static_cap",
        16,
        v.positive(int),
        "Requests in flight the static mode allows.",
        "N",
    )
    gate_floor: int = option(
        "gate.floor",
        2,
        v.positive(int),
        "Lowest cap of the budget, auto and adaptive modes, and their cap before any figures.",
        "N",
    )
    gate_ceiling: int = option(
        "gate.ceiling",
        256,
        v.positive(int),
        "Highest cap of the auto and adaptive modes (and the count cap of the budget mode).",
        "N",
    )
    gate_max_queue: int = option(
        "gate.max_queue",
        256,
        v.positive(int),
        "Requests that may wait in front of the cap; more get 429 with Retry-After.",
        "N",
    )
    gate_max_wait: float = option(
        "gate.max_wait",
        30.0,
        v.positive_duration,
        "Longest wait in the gate's queue: a request the queue's pace says would wait over half "
        "of it gets 429 with Retry-After at once (wait_predicted; the pace is a mean, and the "
        "other half is room for it to run slow), one that waits it all gets it then "
        "(wait_expired).",
        "DURATION",
    )
    gate_order: str = option(
        "gate.order",
        "fifo",
        v.one_of("fifo", "shortest"),
        "Queue order: fifo, or shortest (smallest prompt + max_tokens first).",
        "ORDER",
    )
    gate_fairness_header: str | None = option(
        "gate.fairness_header",
        None,
        v.optional_header,
        "A request header naming its fairness key (a tenant, a team, an API key): the keys of "
        "a priority band are served round-robin from the queue, so one key's burst does not "
        "hold back the others. Unset: no fairness key.",
        "HEADER",
    )
    gate_priority_header: str | None = option(
        "gate.priority_header",
        None,
        v.optional_header,
        "A request header holding its priority, an integer from -1000 to 1000 (higher first; "
        "absent or other: 0): the queue serves bands strictly, the highest first. Unset: one "
        "band.",
        "HEADER",
    )
    gate_fair_reserve: bool = option(
        "gate.fair_reserve",
        "false",
        v.boolean,
        "With --gate.fairness-header: a key with requests in flight leaves one slot of the "
        "cap free for each other key of its band seen in the last minute that has none, so a "
        "quiet key's next request is let in at once. Those slots stay idle while it is quiet.",
        "BOOL",
    )
    gate_token_budget: int | None = option(
        "gate.token_budget",
        None,
        v.optional_positive_int,
        "Most prompt + max_tokens one request may ask for, with the gate on; see "
        "--gate.over-budget.",
        "TOKENS",
    )
    gate_over_budget: str = option(
        "gate.over_budget",
        "reject",
        v.one_of("reject", "clamp"),
        "A request over --gate.token-budget: reject (400) or clamp its max_tokens.",
        "ACTION",
    )
    gate_max_model_len: int | None = option(
        "gate.max_model_len",
        None,
        v.optional_positive_int,
        "The model's max length (vLLM --max-model-len): the worst case of a request that "
        "states no max_tokens. Unset: the whole KV pool.",
        "TOKENS",
    )
    gate_block_size: int | None = option(
        "gate.block_size",
        None,
        v.optional_positive_int,
        "vLLM's KV block size in tokens (--block-size), to count footprints in whole blocks. "
        "Unset: vLLM's own, from the block_size of its cache_config_info; 16 until a scrape "
        "shows it (or with a vLLM that does not). Given, it wins.",
        "TOKENS",
    )

    @property
    def effective_timeout(self) -> float:
        return (
            self.scrape_timeout if self.scrape_timeout is not None else self.scrape_interval * 0.8
        )


OPTIONS: tuple[Option, ...] = options_of(Config)

# Settings renamed in place, old key prefix -> new. The old flag, variable and YAML key still
# work, each with a warning naming the new one (the new one wins when both are given); they are
# hidden from --help and listed once at the end of docs/configuration.md.
RENAMED: dict[str, str] = {
    "admission": "gate",  # after 0.2.0: the gate's settings took the name of its metrics
}
# Each old key (``admission.max_queue``) with the option it now names (``gate.max_queue``).
RENAMED_KEYS: dict[str, Option] = renamed_keys(OPTIONS, RENAMED)

# KVTAX_* variables kvtax reads at run time that are not settings of `kvtax serve` (no flag, no
# YAML key), each with what it does; listed in docs/configuration.md.
RUNTIME_SWITCHES: dict[str, str] = {
    "KVTAX_NO_EXTENSIONS": "Set (to anything but empty or `0`): the relay counts and cuts "
    "vLLM's events with its Python scans, not the compiled ones (kvtax.delivery.eventscan: the "
    "token ids' and continuous usage's). Both give the same bytes and counts; the Python ones "
    "cost more CPU per event. For comparing the two, or a build without its C module.",
}
