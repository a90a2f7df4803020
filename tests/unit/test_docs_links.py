"""The README's and docs' links lead somewhere: every relative link names a file of the
repository, and every #anchor a heading of the page it points into (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_slugs_are_githubs() -> None:
    assert slug("The CUDA cell, measured on an H100") == "the-cuda-cell-measured-on-an-h100"
    assert slug("Several models per cell (FineServe, issue 14): KV slab and placement") == \
        "several-models-per-cell-fineserve-issue-14-kv-slab-and-placement"
    assert slug("Benchmark: `tandem bench`") == "benchmark-tandem-bench"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        into = (page.parent / path).resolve() if path else page
        if not into.exists():
            broken.append(target)
        elif anchor and into.suffix == ".md" and anchor not in anchors(into):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
