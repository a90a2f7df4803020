"""``python -m router``: Tandem's public gRPC API (tokenize, route to a cell, stream back)."""

from __future__ import annotations

import sys

from router.config import parse_args
from router.server import serve
from tandem.engine.errors import TandemError
from tandem.service.runtime import run_service, setup_logging


def main(argv: list[str] | None = None) -> None:
    setup_logging("tandem.router")
    try:
        config = parse_args(argv)
    except (ValueError, TandemError) as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        sys.exit(2)
    run_service(lambda stop: serve(config, stop))


if __name__ == "__main__":
    main()
