"""A deployment file (YAML or JSON): the models to serve and the cells to serve them on.

    hardware: H100-SXM             # perf-model preset the operating points are predicted on
    cells:
      - {name: gpu, count: 8, memory_gib: 80}   # count > 1: gpu0 .. gpu7
    models:
      - name: llama8b-fp8
        shape: Llama-3.1-8B        # perf-model preset (tandem.perf.model_shape)
        precision: fp8             # weights: fp16 | bf16 | fp8 | awq | int8 | fp32
        kv_precision: fp8          # optional; the precision's default otherwise
        rate_rps: 6.0
        ttft_slo_ms: 400
        tpot_slo_ms: 100
        mean_input_len: 512
        mean_output_len: 256
      - name: given                # a profiled model: these replace the perf model's estimate
        rate_rps: 2.0
        ttft_slo_ms: 500
        weight_gib: 30
        activation_gib: 2
        kv_gib: 8
        mme: 12.5                  # generated tokens/s per GiB of extra KV
        replicas: 1

Every problem is reported with the entry it is in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.perf.hardware import hardware_preset
from tandem.perf.model_shape import model_preset
from tandem.place.placement import GIB, Cell, ModelProfile, PlacementError, Workload, profile_model, replicate

_GIVEN = ("weight_gib", "activation_gib", "kv_gib", "mme")


@dataclass(frozen=True)
class Deployment:
    cells: tuple[Cell, ...]
    profiles: tuple[ModelProfile, ...]  # every instance (replicas included), in file order


def load_deployment(path: str | Path, *, rate_scale: float = 1.0) -> Deployment:
    text = Path(path).read_text()
    if Path(path).suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    return parse_deployment(data, rate_scale=rate_scale)


def parse_deployment(data: Any, *, rate_scale: float = 1.0) -> Deployment:
    if not isinstance(data, dict):
        raise PlacementError("a deployment is a mapping with 'cells' and 'models'")
    if not rate_scale > 0:
        raise PlacementError(f"rate_scale must be > 0, got {rate_scale}")
    cells: list[Cell] = []
    for i, entry in enumerate(_list(data, "cells")):
        where = f"cells[{i}]"
        name = str(_get(entry, "name", where))
        memory = float(_get(entry, "memory_gib", where)) * GIB
        count = int(entry.get("count", 1))
        if memory <= 0 or count < 1:
            raise PlacementError(f"{where}: memory_gib must be > 0 and count >= 1")
        cells += [Cell(name if count == 1 else f"{name}{k}", memory) for k in range(count)]
    hardware = hardware_preset(str(data.get("hardware", "H100-SXM")))
    profiles: list[ModelProfile] = []
    names: set[str] = set()
    for i, entry in enumerate(_list(data, "models")):
        where = f"models[{i}]"
        name = str(_get(entry, "name", where))
        if name in names:
            raise PlacementError(f"{where}: model name {name!r} is used twice")
        names.add(name)
        rate = float(_get(entry, "rate_rps", where)) * rate_scale
        ttft_s = float(_get(entry, "ttft_slo_ms", where)) / 1e3
        if rate <= 0 or ttft_s <= 0:
            raise PlacementError(f"{where}: rate_rps and ttft_slo_ms must be > 0")
        given = [k for k in _GIVEN if k in entry]
        if given and len(given) != len(_GIVEN):
            raise PlacementError(f"{where}: a given profile needs all of {', '.join(_GIVEN)}")
        if given:
            base = ModelProfile(
                name=name, model=name, rate_rps=rate, ttft_slo_s=ttft_s,
                weight_bytes=float(entry["weight_gib"]) * GIB,
                activation_bytes=float(entry["activation_gib"]) * GIB,
                kv_bytes=float(entry["kv_gib"]) * GIB, mme=float(entry["mme"]),
            )
            profiles += replicate(base, int(entry.get("replicas", 1)))
            continue
        work = Workload(
            rate_rps=rate, ttft_slo_s=ttft_s,
            tpot_slo_s=float(entry.get("tpot_slo_ms", 1e9)) / 1e3,
            mean_input_len=int(entry.get("mean_input_len", 512)),
            mean_output_len=int(entry.get("mean_output_len", 256)),
        )
        shape = model_preset(str(_get(entry, "shape", where)))
        if "tp" in entry:
            shape = shape.with_tp(int(entry["tp"]))
        try:
            profiles += profile_model(name, shape, str(entry.get("precision", "fp16")), hardware, work,
                                      kv_precision=entry.get("kv_precision"),
                                      max_footprint_bytes=max(c.memory_bytes for c in cells))
        except PlacementError as e:
            raise PlacementError(f"{where}: {e}") from None
    return Deployment(tuple(cells), tuple(profiles))


def _list(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = data.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise PlacementError(f"'{key}' must be a non-empty list of mappings")
    return value


def _get(entry: dict[str, Any], key: str, where: str) -> Any:
    if key not in entry:
        raise PlacementError(f"{where}: missing '{key}'")
    return entry[key]
