"""`tandem up --deployment FILE`: place a deployment's models on cells (FineServe's Algorithm 1,
``tandem place``) and say what each cell of this machine runs.

The file is ``tandem place``'s (see ``tandem.place.deployment``) plus what a live cell needs:

    cells:
      - {name: cpu, count: 2, memory_gib: 1.0}    # cpu0, cpu1
    kv_cache_gb: 0.1                              # each started cell's KV pool
    models:
      - name: smol                                # served under this name
        serve: default                            # a --model entry: PATH[:kv=DTYPE][:quant=FORMAT]
        rate_rps: 2
        ttft_slo_ms: 2000
        weight_gib: 0.5                           # a given profile (or shape/precision for the perf model)
        activation_gib: 0.1
        kv_gib: 0.2
        mme: 50

Each cell that placement gives at least one model instance is started with those models (a model
with replicas on two cells runs in both, under one name); cells with none are not started. The
machine's cores are shared out among the started cells, as evenly as they go (a cell gets at
least one; with more cells than cores, cells share cores round robin), and each cell runs
prefill and decode on its cores.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.place.placement import Placement, PlacementError
from tandem.service.model_spec import ModelSpec

DEFAULT_KV_CACHE_GB = 0.25


@dataclass(frozen=True)
class CellPlan:
    """One cell to start: its id, the cores it runs on, its KV pool and its models."""

    cell_id: str
    cores: tuple[int, ...]
    kv_cache_gb: float
    models: tuple[ModelSpec, ...]  # each named (``name=``) as the deployment names it


def read_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    if Path(path).suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise PlacementError(f"{path}: a deployment is a mapping with 'cells' and 'models'")
    return data


def plan_cells(data: dict[str, Any], cores: Sequence[int]) -> tuple[list[CellPlan], Placement]:
    """The cells to start for deployment ``data`` on ``cores``, and the placement they follow."""
    from tandem.place.deployment import parse_deployment
    from tandem.place.placement import place_fineserve

    if not cores:
        raise PlacementError("no cores to run cells on")
    deployment = parse_deployment(data)
    placement = place_fineserve(deployment.profiles, deployment.cells)
    served: dict[str, ModelSpec] = {}
    for i, entry in enumerate(data["models"]):
        if "serve" not in entry:
            raise PlacementError(f"models[{i}]: missing 'serve' (the model to run: a --model entry)")
        try:
            spec = ModelSpec.parse(str(entry["serve"]))
        except ValueError as exc:
            raise PlacementError(f"models[{i}]: {exc}") from None
        if spec.name:
            raise PlacementError(f"models[{i}]: 'serve' takes no name=; the model is served as {entry['name']!r}")
        served[str(entry["name"])] = replace(spec, name=str(entry["name"]))
    kv_cache_gb = float(data.get("kv_cache_gb", DEFAULT_KV_CACHE_GB))
    if not kv_cache_gb > 0:
        raise PlacementError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
    profiles = {p.name: p for p in deployment.profiles}
    started = [cell for cell in placement.cells if placement.resident[cell.name]]
    shares = share_cores(cores, len(started))
    plans = []
    for cell, cell_cores in zip(started, shares, strict=True):
        names = dict.fromkeys(profiles[instance].model for instance in placement.resident[cell.name])
        plans.append(CellPlan(cell.name, cell_cores, kv_cache_gb, tuple(served[name] for name in names)))
    return plans, placement


def share_cores(cores: Sequence[int], num_cells: int) -> list[tuple[int, ...]]:
    """``cores`` split among ``num_cells`` cells in order, as evenly as they go; with fewer cores
    than cells, cell ``i`` gets core ``i mod len(cores)``."""
    if num_cells < 1:
        return []
    ordered = sorted(cores)
    if len(ordered) < num_cells:
        return [(ordered[i % len(ordered)],) for i in range(num_cells)]
    base, extra = divmod(len(ordered), num_cells)
    out, start = [], 0
    for i in range(num_cells):
        size = base + (1 if i < extra else 0)
        out.append(tuple(ordered[start:start + size]))
        start += size
    return out
