"""The shared library type-checks: STYLE asks for mypy-clean code under tandem/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_clean_on_tandem() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "tandem"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
