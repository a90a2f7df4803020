"""``python -m router``: Tandem's public gRPC API (tokenize, route to a cell, stream back)."""

from __future__ import annotations

from router.config import parse_args
from router.server import serve
from tandem.service.runtime import service_main, setup_logging


def main(argv: list[str] | None = None) -> None:
    setup_logging("tandem.router")
    service_main("router", parse_args, serve, argv)


if __name__ == "__main__":
    main()
