"""Named shared-memory tensors: one process creates, any number attach, all see one copy.

On CPU the gpu_agent puts the weights and the KV pool into files under ``/dev/shm`` and the
prefill and decode processes map the same pages (``torch.from_file(shared=True)`` is a
MAP_SHARED mapping), so a K/V write by one process is visible to the other without a copy.
A store is one data file plus a JSON manifest naming each tensor's offset, dtype and shape;
where the files live, and how a dead owner's are told apart and removed, is
:mod:`tandem.engine.shm_files` (torch-free, for the launcher).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.errors import TandemError
from tandem.engine.shm_files import SHM_DIR, InvalidNameError, store_paths

_ALIGN_BYTES = 64  # cache-line (and AVX-512) alignment of every tensor's first byte

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


class SharedMemoryError(TandemError):
    """A shared-memory store is missing, malformed or already exists."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise SharedMemoryError(f"dtype {dtype} cannot be placed in shared memory")


@dataclass(frozen=True)
class TensorEntry:
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * _DTYPES[self.dtype].itemsize


def _paths(name: str) -> tuple[Path, Path]:
    try:
        return store_paths(name)
    except InvalidNameError as exc:
        raise SharedMemoryError(str(exc)) from None


class SharedTensorStore:
    """A set of named tensors living in one shared-memory file.

    ``create`` lays tensors out (copying initial values or leaving zeros) and owns the files:
    ``unlink`` removes them. ``attach`` maps an existing store read-write. Tensors returned by
    either are views of the mapping and stay valid while the store object lives.
    """

    def __init__(self, name: str, entries: dict[str, TensorEntry], data: torch.Tensor, owner: bool):
        self.name = name
        self.entries = entries
        self._data = data  # [total_bytes] uint8, the whole mapping
        self.owner = owner
        self.tensors: dict[str, torch.Tensor] = {k: self._view(e) for k, e in entries.items()}

    def _view(self, entry: TensorEntry) -> torch.Tensor:
        raw = self._data[entry.offset : entry.offset + entry.nbytes]
        return raw.view(_DTYPES[entry.dtype]).view(entry.shape)

    @classmethod
    def create(
        cls,
        name: str,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        initial: Mapping[str, torch.Tensor] | None = None,
        exist_ok: bool = False,
    ) -> SharedTensorStore:
        """Create the store with a zeroed tensor per spec, copying ``initial`` values in."""
        data_path, manifest_path = _paths(name)
        if data_path.exists() and not exist_ok:
            raise SharedMemoryError(f"shared-memory store {name!r} already exists at {data_path}")
        entries: dict[str, TensorEntry] = {}
        offset = 0
        for key, (shape, dtype) in specs.items():
            entry = TensorEntry(offset, dtype_name(dtype), tuple(int(d) for d in shape))
            entries[key] = entry
            offset += -(-entry.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        total = max(offset, _ALIGN_BYTES)
        SHM_DIR.mkdir(parents=True, exist_ok=True)
        # Owner-only (0600): the weights, and the KV cache that holds users' prompts, are no
        # other local user's to read; the cell's services run as the agent's user.
        fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # also when the file existed (exist_ok)
            os.ftruncate(fd, total)  # sparse: pages cost memory only once touched
        finally:
            os.close(fd)
        data = torch.from_file(str(data_path), shared=True, size=total, dtype=torch.uint8)
        store = cls(name, entries, data, owner=True)
        for key, value in (initial or {}).items():
            store.tensors[key].copy_(value)
        # The manifest appears last: an attacher that finds it finds a complete store.
        tmp = manifest_path.with_suffix(".tmp")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        tmp.write_text(
            json.dumps(
                {
                    "total_bytes": total,
                    "tensors": {
                        k: {"offset": e.offset, "dtype": e.dtype, "shape": list(e.shape)}
                        for k, e in entries.items()
                    },
                }
            )
        )
        tmp.replace(manifest_path)
        return store

    @classmethod
    def from_tensors(
        cls, name: str, tensors: Mapping[str, torch.Tensor], exist_ok: bool = False
    ) -> SharedTensorStore:
        specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
        return cls.create(name, specs, initial=tensors, exist_ok=exist_ok)

    @classmethod
    def attach(cls, name: str) -> SharedTensorStore:
        data_path, manifest_path = _paths(name)
        if not manifest_path.is_file() or not data_path.is_file():
            raise SharedMemoryError(
                f"shared-memory store {name!r} not found in {SHM_DIR} (has its owner started?)"
            )
        manifest = json.loads(manifest_path.read_text())
        entries = {
            k: TensorEntry(int(v["offset"]), str(v["dtype"]), tuple(int(d) for d in v["shape"]))
            for k, v in manifest["tensors"].items()
        }
        total = int(manifest["total_bytes"])
        if data_path.stat().st_size < total:
            raise SharedMemoryError(f"shared-memory store {name!r} is truncated")
        data = torch.from_file(str(data_path), shared=True, size=total, dtype=torch.uint8)
        return cls(name, entries, data, owner=False)

    def unlink(self) -> None:
        """Remove the files (mappings already made stay valid until their tensors die)."""
        for path in _paths(self.name):
            path.unlink(missing_ok=True)

    @staticmethod
    def exists(name: str) -> bool:
        return _paths(name)[1].is_file()
