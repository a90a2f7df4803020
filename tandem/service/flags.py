"""Command-line flags that each have a ``TANDEM_*`` environment twin, declared on config fields.

``--kv-cache-gb`` reads ``TANDEM_KV_CACHE_GB`` when the flag is absent; the flag wins. Every
process's frozen config dataclass declares its flags on its fields (``field(metadata=flag(...))``:
name, default, help, type, and how the flag's text becomes the field's value), and
``parse_config`` builds the parser from those alone, so a flag is written in one place.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

C = TypeVar("C")


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


@dataclass(frozen=True)
class FlagSpec:
    """A config field's command-line flag: its name (the TANDEM_* twin follows from it), the
    flag's default and help, the argparse type, and how the flag's value becomes the field's."""

    name: str
    default: Any
    help: str
    type: Callable[[str], Any]
    parse: Callable[[Any], Any]
    kwargs: dict[str, Any]  # more add_argument options (choices)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def flag(name: str, default: Any, help: str, *, type: Callable[[str], Any] = str,
         parse: Callable[[Any], Any] | None = None, **kwargs: Any) -> dict[str, FlagSpec]:
    """Field metadata that declares the field's flag: ``field(metadata=flag("--port", 50061, ...))``."""
    return {"flag": FlagSpec(name, default, help, type, parse or (lambda value: value), kwargs)}


def flag_specs(config_type: type) -> list[tuple[str, FlagSpec]]:
    """(field name, flag) of every field of ``config_type`` that declares a flag, in field order."""
    return [(f.name, f.metadata["flag"]) for f in fields(config_type) if "flag" in f.metadata]


def parse_config(config_type: type[C], argv: Sequence[str] | None, prog: str, description: str) -> C:
    """``config_type`` built from ``argv`` and TANDEM_* variables, one flag per field that declares
    one; the config's own checks raise ValueError for invalid values."""
    assert is_dataclass(config_type)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    flagged = flag_specs(config_type)
    for _, spec in flagged:
        add_flag(parser, spec.name, spec.default, spec.help, type=spec.type, **spec.kwargs)
    args = vars(parser.parse_args(argv))
    return config_type(**{name: spec.parse(args[spec.dest]) for name, spec in flagged})


def env_or(variable: str) -> Callable[[str], str]:
    """A flag parser for text that falls back to environment ``variable`` when empty (REDIS_URL)."""
    return lambda text: text or os.environ.get(variable, "")
