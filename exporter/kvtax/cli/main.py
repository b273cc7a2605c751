"""The ``kvtax`` command line: ``serve`` runs the sidecar; other subcommands generate artifacts.

Flags of ``serve`` are generated from :data:`kvtax.serve.config.OPTIONS`, so ``--help``, the
environment variables and ``docs/configuration.md`` cannot disagree. Bad input to any
subcommand (a :class:`kvtax.errors.InputError`, a bad setting of ``serve`` included) is caught
here, once: one line ``kvtax <command>: <message>`` on stderr, the message naming the flag,
setting or file at fault, and exit status 2.
``docs``, ``rules`` and ``dashboards generate`` write or ``--check`` their files through
:mod:`kvtax.cli.generated`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtax import __version__
from kvtax.cli.checkout import harness_missing, needs_checkout
from kvtax.cli.generated import add_output_arguments, write_or_check
from kvtax.errors import InputError
from kvtax.serve import logformat
from kvtax.serve.config import (
    OPTIONS,
    RENAMED_KEYS,
    Config,
    Option,
    flag_name,
    load_config,
    unknown_env,
)

if TYPE_CHECKING:
    from asyncio import AbstractEventLoop

__all__ = ["build_parser", "main"]

log = logging.getLogger("kvtax")

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, Command] = {}

# The subcommands of the mixin and the offline tools, each in its own module of kvtax.cli with
# ``add_parser(sub, help)`` and ``run(args)``. A module is imported only when its subcommand
# runs, so ``kvtax serve`` and ``kvtax --help`` never load the planner, the load tester or the
# rule and dashboard generators; the help line of each lives here for ``kvtax --help``.
LAZY: dict[str, tuple[str, str]] = {
    "rules": (
        "kvtax.cli.rules",
        "Write the generated Prometheus rules and Alertmanager example.",
    ),
    "dashboards": (
        "kvtax.cli.dashboards",
        "Generate the Grafana dashboards, or preview them as PNG.",
    ),
    "loadtest": (
        "kvtax.cli.loadtest",
        "Sweep load against an OpenAI-compatible server and find where preemption begins.",
    ),
    "annotate": (
        "kvtax.cli.annotate",
        "Add the engine's preemptions, tax, KV usage and thrash state to a benchmark report "
        "(guidellm, AIPerf, vllm bench serve), or record the engine during a benchmark.",
    ),
    "plan": (
        "kvtax.cli.plan",
        "Size KV cache and max_num_seqs before deploying; --what-if predicts the tax.",
    ),
}


def command(name: str) -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        _COMMANDS[name] = fn
        return fn

    return register


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config.file",
        dest="config_file",
        type=Path,
        metavar="PATH",
        help="YAML file with settings (env KVTAX_CONFIG_FILE).",
    )
    shown = [(o.key, o, _flag_help(o)) for o in OPTIONS]
    # A renamed setting's old flag still works (load_config warns); --help leaves it out.
    hidden = [(old, o, argparse.SUPPRESS) for old, o in RENAMED_KEYS.items()]
    for key, option, help in (*shown, *hidden):
        # Accept the underscore spelling too: it is what the YAML and env keys use.
        spellings = dict.fromkeys([flag_name(key), f"--{key}"])
        parser.add_argument(
            *spellings,
            dest=key,
            metavar=option.metavar,
            # None, not the option's default: load_config falls through to the environment, the
            # file, then Config's own default, so argparse must not hold a second one.
            default=None,
            # A switch given bare means true; --push.allow-unauthenticated=false still parses.
            nargs="?" if option.switch else None,
            const="true" if option.switch else None,
            help=help,
        )


def _flag_help(option: Option) -> str:
    """The ``--help`` line of a setting: its help, variable and default, as in the docs."""
    text = f"{option.help} (env {option.env}; default: {option.default_text})"
    # argparse %-formats help text, so a literal "%" in the table must be doubled.
    return text.replace("%", "%%")


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not a flag (the top-level parser
    has flags only, none taking a value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvtax`` parser. Of the lazily loaded subcommands, only the one ``argv`` chooses is
    built in full (all of them when ``argv`` is None); the others carry their help line."""
    chosen = _chosen(argv) if argv is not None else None
    parser = argparse.ArgumentParser(
        prog="kvtax",
        description="A vLLM sidecar that measures the KV-cache preemption tax.",
    )
    parser.add_argument("--version", action="version", version=f"kvtax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="Run the sidecar: scrape vLLM and serve /metrics.",
        description="Scrape vLLM's /metrics, derive the preemption tax and "
        "serve kvtax's own /metrics.",
    )
    _add_config_flags(serve)
    demo = sub.add_parser(
        "demo",
        help="Show the preemption tax live on a real vLLM CPU engine (installs it once).",
        description="Start a real vLLM CPU engine with a tiny local model and a small KV pool, "
        "and kvtax with its proxy; drive an overload, then a load that fits, and show what "
        "kvtax publishes. Everything started is stopped on exit, Ctrl-C included. Runs from "
        "a checkout of the kvtax repository (scripts/demo), not from an installed kvtax.",
    )
    demo.add_argument(
        "--short", action="store_true", help="Smaller loads, for CI and slow machines."
    )
    demo.add_argument(
        "--with-prometheus",
        action="store_true",
        help="Also run Prometheus and Alertmanager with kvtax's rules, show the pages that "
        "fire (preemptions and the error budget's burn, with their runbooks), and render "
        "dashboard previews, naming the panels without data.",
    )
    demo.add_argument(
        "--previews-out",
        type=Path,
        default=Path("kvtax-demo-previews"),
        metavar="DIR",
        help="Where --with-prometheus writes the dashboard PNGs (default kvtax-demo-previews).",
    )
    docs = sub.add_parser("docs", help="Write the generated metrics and configuration references.")
    add_output_arguments(docs, Path("docs"))
    for name, (module, help) in LAZY.items():
        if argv is None or name == chosen:
            loaded = importlib.import_module(module)
            loaded.add_parser(sub, help)
            _COMMANDS[name] = loaded.run
        else:
            sub.add_parser(name, help=help)
    return parser


def config_from_args(
    args: argparse.Namespace, env: dict[str, str], warnings: list[str] | None = None
) -> Config:
    """The config ``args`` and ``env`` give; old names of renamed settings add to ``warnings``."""
    flags = {key: getattr(args, key, None) for key in [*(o.key for o in OPTIONS), *RENAMED_KEYS]}
    file = args.config_file or (
        Path(env["KVTAX_CONFIG_FILE"]) if env.get("KVTAX_CONFIG_FILE") else None
    )
    return load_config(flags, env=env, file=file, warnings=warnings)


@command("serve")
def _serve(args: argparse.Namespace) -> int:
    # The server stack (aiohttp, asyncio, the proxy) loads only for `serve`: every other
    # subcommand, and --help, starts without it.
    import asyncio

    from kvtax.serve import logsafe
    from kvtax.serve.wiring import run

    renamed: list[str] = []
    config = config_from_args(args, dict(os.environ), renamed)
    logformat.install(config.log_level, config.log_format)
    # Before any server starts: aiohttp logs a malformed request's header bytes, token and all.
    logsafe.install()
    for warning in [*renamed, *unknown_env(os.environ)]:
        log.warning("%s", warning)
    if config.log_level != "debug":
        # APScheduler logs two INFO lines per job run: one scrape a second would drown the log.
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(run(config))


def _loop_factory() -> Callable[[], AbstractEventLoop] | None:
    """uvloop where it is installed (a dependency on Linux): the relay's per-chunk cost is
    mostly event-loop and transport work, which uvloop does in C. Else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@command("demo")
def _demo(args: argparse.Namespace) -> int:
    # The demo is development harness (a real engine, load, Prometheus): not in the wheel.
    try:
        from kvtax_dev.demo import run_demo
    except ModuleNotFoundError as exc:
        if not harness_missing(exc):
            raise
        print(needs_checkout("kvtax demo", "scripts/demo"), file=sys.stderr)
        return 2
    return run_demo(args)


@command("docs")
def _docs(args: argparse.Namespace) -> int:
    from kvtax.engine import vocabulary
    from kvtax.expose import reference
    from kvtax.serve import config

    pages = {
        "metrics.md": reference.render_markdown(),
        "configuration.md": config.render_markdown(),
        "compatibility.md": vocabulary.render_markdown(),
    }
    return write_or_check(pages, args.out, check=args.check, command="kvtax docs")


def _named(args: argparse.Namespace) -> str:
    """The command as typed: ``kvtax plan``, or ``kvtax dashboards generate`` when the
    subcommand has actions of its own (their ``dest`` is ``<command>_command``)."""
    action = getattr(args, f"{args.command}_command", None)
    return " ".join(["kvtax", args.command, *([action] if action else [])])


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(words)
    except ModuleNotFoundError as exc:
        # kvtax's image leaves out the offline tools (see the Dockerfile): say where they are.
        if not (exc.name or "").startswith("kvtax.tools"):
            raise
        print(
            f"kvtax {_chosen(words)}: the offline tools are not installed here (kvtax's image "
            "carries only what runs in the pod); run `pip install kvtax` on a workstation",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(words)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _COMMANDS[args.command](args)
    except InputError as exc:
        # The one catch of bad input, whichever subcommand met it: one line naming the field.
        print(f"{_named(args)}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
