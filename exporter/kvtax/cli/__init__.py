"""The ``kvtax`` command line: :mod:`kvtax.cli.main` parses and dispatches; each subcommand of
the mixin and the offline tools has its own module here, imported only when it runs."""

from kvtax.cli.main import build_parser, config_from_args, main

__all__ = ["build_parser", "config_from_args", "main"]
