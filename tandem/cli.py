"""The ``tandem`` command line: one sub-command per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from tandem import ask_cli, health_cli, launcher
    from tandem.bench import cli as bench_cli
    from tandem.engine import chat_cli, models_cli
    from tandem.perf import profile_cli
    from tandem.place import cli as place_cli
    from tandem.sim import cli as sim_cli

    launcher.add_parser(sub)
    ask_cli.add_parser(sub)
    health_cli.add_parser(sub)
    chat_cli.add_parser(sub)
    models_cli.add_parser(sub)
    profile_cli.add_parser(sub).set_defaults(func=_profile)
    bench_cli.add_parser(sub)
    sim_cli.add_parser(sub)
    place_cli.add_parser(sub)
    return parser


def _profile(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        from tandem.cuda import profile_cli as cuda_profile_cli

        return cuda_profile_cli.run(args)
    from tandem.perf import profile_cli

    return profile_cli.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
