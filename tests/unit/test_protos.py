"""The committed generated gRPC code is what protoc makes from protos/ today."""

from __future__ import annotations

from pathlib import Path

from tandem.rpc import codegen


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = {p.name: p.read_text() for p in codegen.generate(tmp_path)}
    committed = {p.name: p.read_text() for p in codegen.OUT_DIR.iterdir() if p.is_file()}
    stale = sorted(name for name in fresh if committed.get(name) != fresh[name])
    extra = sorted(set(committed) - set(fresh))
    assert not stale and not extra, (
        f"generated code is stale: {stale} differ, {extra} have no proto; run `python -m tandem.rpc.codegen`"
    )


def test_every_field_and_enum_is_documented() -> None:
    """STYLE: a comment on every field; enums start with *_UNSPECIFIED = 0."""
    for proto in sorted((codegen.PROTO_ROOT / "tandem" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "syntax"))
            is_field = is_field and not stripped.endswith("_UNSPECIFIED = 0;")  # self-describing
            if is_field:
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {stripped}"
            if stripped.startswith("enum "):
                first = lines[i + 1].strip()
                assert first.endswith("_UNSPECIFIED = 0;"), f"{proto.name}:{i + 2} enum must start with *_UNSPECIFIED"
