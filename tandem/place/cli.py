"""``tandem place``: put the models of a deployment file on its cells by FineServe's Algorithm 1
(or the Prism-like baseline) and print the placement table; ``--json`` writes it too."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``place`` to ``subparsers``; it sets ``func``, which returns the exit code."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "place", help="place models on cells (FineServe's global scheduler)", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("deployment", help="deployment file (YAML or JSON; see tandem/place/deployment.py)")
    parser.add_argument("--policy", choices=("fineserve", "prism"), default="fineserve",
                        help="fineserve: Algorithm 1; prism: the Prism-like baseline")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply every model's rate")
    parser.add_argument("--json", default=None, help="also write the placement to this JSON file")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from tandem.place.deployment import load_deployment
    from tandem.place.placement import GIB, PlacementError, place_fineserve, place_prism

    try:
        deployment = load_deployment(args.deployment, rate_scale=args.rate_scale)
        place = place_fineserve if args.policy == "fineserve" else place_prism
        placement = place(deployment.profiles, deployment.cells)
    except (OSError, PlacementError, KeyError) as e:
        print(f"tandem place: {e}", file=sys.stderr)
        return EXIT_ERROR
    rows = placement.table(deployment.profiles)
    columns = ("order", "instance", "cell", "rate_rps", "batch_size", "weights_gib", "activations_gib",
               "kv_gib", "footprint_gib", "mme_tok_s_per_gib", "score")
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in columns))
    print()
    for cell in placement.cells:
        names = ", ".join(placement.resident[cell.name]) or "-"
        print(f"{cell.name}: {names}  (remaining {placement.remaining_bytes[cell.name] / GIB:.2f} "
              f"of {cell.memory_bytes / GIB:.2f} GiB)")
    if args.json:
        out: dict[str, Any] = {
            "policy": args.policy, "rate_scale": args.rate_scale, "instances": rows,
            "cells": {c.name: list(placement.resident[c.name]) for c in placement.cells},
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return EXIT_OK
