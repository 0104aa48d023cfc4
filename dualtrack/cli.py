"""The `dualtrack` command: one console script; each subcommand lives in a module of this package."""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> module. Each module defines HELP (one line), add_arguments(parser) and
#: run(args) -> int (the exit code). Modules import heavy libraries inside run(), not at import.
SUBCOMMANDS: dict[str, str] = {
    "explain": "dualtrack.explain",
    "janitor": "dualtrack.janitor",
    "replay": "dualtrack.replay",
    "report": "dualtrack.report",
}


class OneLineParser(argparse.ArgumentParser):
    """Bad flags: one line on stderr and exit 2 (argparse's default also prints the usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


#: What `dualtrack --help` says (for users: commands, not modules).
DESCRIPTION = ("Post-mortems and housekeeping for runs monitored by dualtrack: explain a run, rebuild its "
               "series, write its report, clean up the Pushgateway.")
EPILOG = "`dualtrack COMMAND --help` describes each command's options."


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="dualtrack", description=DESCRIPTION, epilog=EPILOG)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True,
                                     parser_class=OneLineParser)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
