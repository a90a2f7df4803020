"""CUDA tensors shared between processes by handle: the weights and the KV pool exist once, in
the process that allocated them (the agent), and every other process maps the same bytes.

``export_tensors`` turns named CUDA tensors into bytes: for each, torch's CUDA IPC description
(``torch.multiprocessing.reductions.reduce_tensor``: the allocation's ``cudaIpcMemHandle``, the
storage's size and offset in it, torch's reference counter and event handles) plus shape, stride
and dtype, as JSON with the handles in base64. Those bytes are metadata: they travel in a gRPC
``bytes`` field or a file, never the tensor. ``open_tensors`` in another process rebuilds each
tensor over the same device memory (``rebuild_cuda_tensor``); a write by either side is seen by
the other after the usual stream synchronisation.

Rules (CUDA's): a handle opens only in another process of the same machine and device; the
exporting process must keep its tensors alive while any importer uses them (the agent keeps
weights and pool for its whole life); torch's reference counter lets the exporter know when
importers are gone.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor, rebuild_cuda_tensor

_FORMAT = "tandem-cuda-ipc/1"
# reduce_tensor's argument tuple for a CUDA tensor, by position (torch >= 2.0).
_FIELDS = (
    "tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle",
    "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
    "ref_counter_offset", "event_handle", "event_sync_required",
)
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.device.type != "cuda":
        raise ValueError(f"only CUDA tensors are shared by IPC handle, got one on {tensor.device}")
    rebuild, args = reduce_tensor(tensor)
    if rebuild is not rebuild_cuda_tensor or len(args) != len(_FIELDS):
        raise RuntimeError("this torch's CUDA IPC description has an unexpected form")
    raw = dict(zip(_FIELDS, args, strict=True))
    out: dict[str, Any] = {
        "size": list(raw["size"]), "stride": list(raw["stride"]), "tensor_offset": raw["tensor_offset"],
        "dtype": str(raw["dtype"]).removeprefix("torch."), "device": int(raw["device"]),
        "storage_size_bytes": raw["storage_size_bytes"], "storage_offset_bytes": raw["storage_offset_bytes"],
        "ref_counter_offset": raw["ref_counter_offset"], "event_sync_required": bool(raw["event_sync_required"]),
    }
    for name in _BYTES_FIELDS:
        value = raw[name]
        out[name] = None if value is None else base64.b64encode(bytes(value)).decode()
    return out


def _rebuild(d: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {d['dtype']!r} in a CUDA IPC handle")
    handles = {name: None if d[name] is None else base64.b64decode(d[name]) for name in _BYTES_FIELDS}
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["tensor_offset"], torch.storage.TypedStorage,
        dtype, d["device"], handles["handle"], d["storage_size_bytes"], d["storage_offset_bytes"], False,
        handles["ref_counter_handle"], d["ref_counter_offset"], handles["event_handle"], d["event_sync_required"],
    )


def export_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """Handles of named CUDA tensors, as bytes for a gRPC field (the caller keeps them alive)."""
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"only CUDA tensors are shared by IPC handle, got {name!r} on {t.device}")
    torch.cuda.synchronize()  # what was written before the export is visible to the importer
    return json.dumps({"format": _FORMAT, "tensors": {k: _describe(t) for k, t in tensors.items()}}).encode()


def open_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors behind ``export_tensors``'s bytes, mapped in this process (not copied)."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a CUDA IPC description: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
        raise ValueError(f"not a {_FORMAT} description")
    return {name: _rebuild(d) for name, d in raw["tensors"].items()}


def export_tensor(tensor: torch.Tensor) -> bytes:
    return export_tensors({"t": tensor})


def open_tensor(data: bytes) -> torch.Tensor:
    return open_tensors(data)["t"]
