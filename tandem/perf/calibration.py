"""Calibration (Bullet Eq. 2) and the contention guard (MuxWise §3.3.2)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PHASES = ("prefill", "decode", "hybrid")


@dataclass(frozen=True)
class CalibrationSample:
    """One profiled execution: what was measured and what the uncalibrated roofline predicted."""

    phase: str
    num_tokens: int
    units: int
    measured_s: float
    predicted_s: float

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.num_tokens <= 0 or self.units <= 0:
            raise ValueError("num_tokens and units must be positive")
        if not (self.measured_s > 0 and self.predicted_s > 0):
            raise ValueError("measured_s and predicted_s must be positive")

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


def _token_key(num_tokens: float) -> float:
    return math.log2(max(1.0, num_tokens))


class Calibration:
    """alpha = measured / predicted per phase, piecewise-linear over log2(tokens).

    Between knots the factor is interpolated, outside it is clamped to the nearest knot; a
    phase with no knot uses 1.0. Execution states that differ only in units share a factor
    (Bullet §3.2.2: two samples suffice across SM counts once the roofline scales units),
    unless the fit was given samples per unit count: then each count measured has its own
    curve (key "<phase>@<units>"), used for that count, and the shared one for the rest. On a
    CPU the roofline's unit scaling is the weakest part (a second core shares caches and the
    memory controller), so the per-count curves are what make held-out errors small there.
    `update` moves the nearest knot toward a live sample by an EWMA, or adds a knot when the
    sample lies more than `knot_spacing` (in log2 tokens) from every knot.

    ``host_floor_s`` (per phase, seconds) is the host's time to launch a phase run op by op
    (a GPU's eager prefill: about a thousand kernel launches whatever the token count). A run
    takes at least that long however few its tokens, so `predict` is the larger of the floor
    and the calibrated roofline; and a sample whose roofline time is under the floor measured
    the host, not the device, so it gives no knot (fit) and moves none (update).
    """

    def __init__(
        self,
        knots: Mapping[str, Sequence[tuple[float, float]]] | None = None,
        *,
        ewma_weight: float = 0.2,
        knot_spacing: float = 0.5,
        host_floor_s: Mapping[str, float] | None = None,
    ) -> None:
        if not 0 < ewma_weight <= 1:
            raise ValueError(f"ewma_weight must be in (0, 1], got {ewma_weight}")
        floors = dict(host_floor_s or {})
        if any(p not in PHASES or not (v >= 0) for p, v in floors.items()):
            raise ValueError(f"host_floor_s must map phases {PHASES} to seconds >= 0, got {floors}")
        self.host_floor_s = floors
        self.ewma_weight = ewma_weight
        self.knot_spacing = knot_spacing
        self._xs: dict[str, list[float]] = {}
        self._ys: dict[str, list[float]] = {}
        for phase, points in (knots or {}).items():
            for x, y in sorted(points):
                self._insert(phase, x, y)

    @classmethod
    def fit(cls, samples: Iterable[CalibrationSample], *, per_units: bool = False,
            host_floor_s: Mapping[str, float] | None = None, **kwargs: float) -> Calibration:
        """Knots at each distinct token count: the geometric mean of its samples' ratios; with
        ``per_units`` also one curve per unit count (see the class docstring). Samples under
        their phase's host floor give no knot."""
        floors = dict(host_floor_s or {})
        groups: dict[tuple[str, float], list[float]] = {}
        for s in samples:
            if s.predicted_s < floors.get(s.phase, 0.0):
                continue
            x = round(_token_key(s.num_tokens), 6)
            groups.setdefault((s.phase, x), []).append(math.log(s.ratio))
            if per_units:
                groups.setdefault((f"{s.phase}@{s.units}", x), []).append(math.log(s.ratio))
        knots: dict[str, list[tuple[float, float]]] = {}
        for (phase, x), logs in groups.items():
            knots.setdefault(phase, []).append((x, math.exp(sum(logs) / len(logs))))
        return cls(knots, host_floor_s=floors, **kwargs)

    def _insert(self, phase: str, x: float, y: float) -> None:
        xs = self._xs.setdefault(phase, [])
        ys = self._ys.setdefault(phase, [])
        i = bisect.bisect_left(xs, x)
        xs.insert(i, x)
        ys.insert(i, y)

    def knots(self, phase: str) -> list[tuple[float, float]]:
        return list(zip(self._xs.get(phase, []), self._ys.get(phase, [])))

    def factor(self, phase: str, num_tokens: float, units: int | None = None) -> float:
        if units is not None and f"{phase}@{units}" in self._xs:
            phase = f"{phase}@{units}"
        xs = self._xs.get(phase)
        if not xs:
            return 1.0
        ys = self._ys[phase]
        x = _token_key(num_tokens)
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        x0, x1 = xs[i - 1], xs[i]
        t = (x - x0) / (x1 - x0)
        return ys[i - 1] + t * (ys[i] - ys[i - 1])

    def predict(self, phase: str, roofline_s: float, num_tokens: float, units: int | None = None) -> float:
        """Seconds of a run whose uncalibrated roofline time is ``roofline_s``: the calibrated
        time, or the phase's host floor where that is longer."""
        return max(self.host_floor_s.get(phase, 0.0), roofline_s * self.factor(phase, num_tokens, units))

    def update(self, sample: CalibrationSample) -> None:
        if sample.predicted_s < self.host_floor_s.get(sample.phase, 0.0):
            return  # it timed the host's launches
        phase = sample.phase
        if f"{phase}@{sample.units}" in self._xs:
            phase = f"{phase}@{sample.units}"
        x = _token_key(sample.num_tokens)
        xs = self._xs.get(phase, [])
        if xs:
            i = min(range(len(xs)), key=lambda j: abs(xs[j] - x))
            if abs(xs[i] - x) <= self.knot_spacing:
                ys = self._ys[phase]
                ys[i] += self.ewma_weight * (sample.ratio - ys[i])
                return
        self._insert(phase, x, sample.ratio)

    def to_dict(self) -> dict[str, list[list[float]]]:
        return {phase: [[x, y] for x, y in self.knots(phase)] for phase in self._xs}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Sequence[Sequence[float]]]) -> Calibration:
        return cls({phase: [(float(p[0]), float(p[1])) for p in pts] for phase, pts in raw.items()})


class ContentionGuard:
    """Worst slowdown of a phase on `units` while the other phase runs on `other_units`.

    A coarse grid (MuxWise §3.3.2 partitions at 16-SM steps): `slowdowns[phase][i][j]` is the
    largest measured/solo ratio seen with `unit_points[i]` own units and `unit_points[j]` other
    units. `lookup` is conservative: the max over the grid cells around the query (both
    neighbours on each axis), never below 1.0, and 1.0 when the other phase is idle. A phase with
    no grid gets `default_slowdown`. `record` only ever raises cells (online refinement).
    """

    def __init__(
        self,
        unit_points: Sequence[int],
        slowdowns: Mapping[str, Sequence[Sequence[float]]] | None = None,
        *,
        default_slowdown: float = 1.0,
    ) -> None:
        points = list(unit_points)
        if not points or points != sorted(set(points)) or points[0] <= 0:
            raise ValueError(f"unit_points must be positive, strictly increasing, got {unit_points}")
        self.unit_points = points
        self.default_slowdown = default_slowdown
        self._grid: dict[str, list[list[float]]] = {}
        for phase, rows in (slowdowns or {}).items():
            grid = [[max(1.0, float(v)) for v in row] for row in rows]
            if len(grid) != len(points) or any(len(r) != len(points) for r in grid):
                raise ValueError(f"slowdown grid for {phase!r} must be {len(points)}x{len(points)}")
            self._grid[phase] = grid

    def _neighbours(self, units: float) -> tuple[int, ...]:
        pts = self.unit_points
        i = bisect.bisect_left(pts, units)
        if i < len(pts) and pts[i] == units:
            return (i,)
        if i == 0:
            return (0,)
        if i == len(pts):
            return (len(pts) - 1,)
        return (i - 1, i)

    def lookup(self, phase: str, units: float, other_units: float) -> float:
        if other_units <= 0:
            return 1.0
        grid = self._grid.get(phase)
        if grid is None:
            return max(1.0, self.default_slowdown)
        return max(grid[i][j] for i in self._neighbours(units) for j in self._neighbours(other_units))

    def record(self, phase: str, units: float, other_units: float, slowdown: float) -> None:
        """Raise the cells a live observation falls into to at least `slowdown`."""
        if other_units <= 0:
            return
        n = len(self.unit_points)
        grid = self._grid.setdefault(phase, [[max(1.0, self.default_slowdown)] * n for _ in range(n)])
        for i in self._neighbours(units):
            for j in self._neighbours(other_units):
                grid[i][j] = max(grid[i][j], slowdown)

    def to_dict(self) -> dict[str, object]:
        return {
            "unit_points": list(self.unit_points),
            "default_slowdown": self.default_slowdown,
            "slowdowns": {phase: [list(r) for r in grid] for phase, grid in self._grid.items()},
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> ContentionGuard:
        points = raw["unit_points"]
        slowdowns = raw.get("slowdowns") or {}
        default = raw.get("default_slowdown", 1.0)
        assert isinstance(points, list) and isinstance(slowdowns, dict) and isinstance(default, (int, float))
        return cls(points, slowdowns, default_slowdown=float(default))
