"""Command-line flags that each have a ``TANDEM_*`` environment twin.

``--kv-cache-gb`` reads ``TANDEM_KV_CACHE_GB`` when the flag is absent; the flag wins. Every
process's frozen config dataclass is built from the parsed namespace.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def env_name(flag: str) -> str:
    return "TANDEM_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    default: Any,
    help: str,
    type: Callable[[str], Any] = str,
    **kwargs: Any,
) -> None:
    """Add ``flag`` whose default comes from its ``TANDEM_*`` variable, else ``default``."""
    env = env_name(flag)
    raw = os.environ.get(env)
    value = type(raw) if raw not in (None, "") else default
    parser.add_argument(flag, default=value, type=type, help=f"{help} [env {env}; default {default!r}]", **kwargs)


def parse_bool(text: str) -> bool:
    """A flag's or environment variable's boolean: 1/true/yes/on or 0/false/no/off."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


def parse_cores(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` → ``(0, 2, 3)``; an empty string is no cores."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part:
            lo, hi = part.split("-", 1)
            cores.extend(range(int(lo), int(hi) + 1))
        else:
            cores.append(int(part))
    return tuple(cores)
