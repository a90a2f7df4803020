"""The profile file: what `tandem profile` measured on a device, loaded by the agent and router.

JSON, version 1:
{
  "version": 1,
  "hardware": {HardwareSpec fields; gemm_tiles as [[t, f], ...]},
  "model": "Llama-3.1-8B" | null,
  "units": [unit counts that were profiled],
  "calibration_samples": [{"phase", "num_tokens", "units", "measured_s", "predicted_s"}, ...],
  "contention": {"unit_points": [...], "default_slowdown": 1.0,
                 "slowdowns": {"decode": [[...], ...], ...}} | null,
  "heldout_samples": [same form as calibration_samples; shapes NOT used to fit],   (optional)
  "heldout_error": {"prefill": MAPE as a fraction, "prefill@2": on 2 units, ...},  (optional)
  "notes": ["free text for humans: what was measured, what was skipped and why"],  (optional)
  "host_floor_s": {"prefill": seconds the host takes to launch a run op by op}      (optional)
}
The calibration is refitted from the samples on load, so a profile stays valid when the fitting
rule changes. `profile_to_dict` / `profile_from_dict` are pure; only save/load touch files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.perf.calibration import Calibration, CalibrationSample, ContentionGuard
from tandem.perf.hardware import HardwareSpec

PROFILE_VERSION = 1


@dataclass(frozen=True)
class PerfProfile:
    hardware: HardwareSpec
    model: str | None = None
    units: tuple[int, ...] = ()
    calibration_samples: tuple[CalibrationSample, ...] = ()
    contention: ContentionGuard | None = field(default=None, compare=False)
    # Shapes measured in the same run but kept out of the fit, and the calibrated model's mean
    # absolute percentage error on them per phase (a fraction: 0.08 is 8%).
    heldout_samples: tuple[CalibrationSample, ...] = ()
    heldout_error: dict[str, float] = field(default_factory=dict, compare=False)
    notes: tuple[str, ...] = ()
    # Per phase, the host's time to launch a run op by op, which no run of that phase beats
    # (measured for a GPU's eager prefill; see Calibration).
    host_floor_s: dict[str, float] = field(default_factory=dict, compare=False)

    def calibration(self) -> Calibration:
        """The calibration the profile's held-out error was scored on: a curve per unit count
        measured (the shared one for the rest), above the host floors."""
        return Calibration.fit(self.calibration_samples, per_units=True, host_floor_s=self.host_floor_s)


def profile_to_dict(profile: PerfProfile) -> dict[str, Any]:
    hw = dataclasses.asdict(profile.hardware)
    hw["gemm_tiles"] = [list(t) for t in profile.hardware.gemm_tiles]
    return {
        "version": PROFILE_VERSION,
        "hardware": hw,
        "model": profile.model,
        "units": list(profile.units),
        "calibration_samples": [dataclasses.asdict(s) for s in profile.calibration_samples],
        "contention": profile.contention.to_dict() if profile.contention is not None else None,
        "heldout_samples": [dataclasses.asdict(s) for s in profile.heldout_samples],
        "heldout_error": dict(profile.heldout_error),
        "notes": list(profile.notes),
        "host_floor_s": dict(profile.host_floor_s),
    }


def profile_from_dict(raw: dict[str, Any]) -> PerfProfile:
    version = raw.get("version")
    if version != PROFILE_VERSION:
        raise ValueError(
            f"unsupported profile version {version!r}; this Tandem reads version {PROFILE_VERSION}"
        )
    hw_raw = dict(raw["hardware"])
    hw_raw["gemm_tiles"] = tuple((int(t[0]), int(t[1])) for t in hw_raw.get("gemm_tiles", ((256, 128),)))
    hardware = HardwareSpec(**hw_raw)
    samples = tuple(CalibrationSample(**s) for s in raw.get("calibration_samples", ()))
    contention_raw = raw.get("contention")
    return PerfProfile(
        hardware=hardware,
        model=raw.get("model"),
        units=tuple(int(u) for u in raw.get("units", ())),
        calibration_samples=samples,
        contention=ContentionGuard.from_dict(contention_raw) if contention_raw else None,
        heldout_samples=tuple(CalibrationSample(**s) for s in raw.get("heldout_samples", ())),
        heldout_error={str(k): float(v) for k, v in (raw.get("heldout_error") or {}).items()},
        notes=tuple(str(n) for n in raw.get("notes", ())),
        host_floor_s={str(k): float(v) for k, v in (raw.get("host_floor_s") or {}).items()},
    )


def save_profile(profile: PerfProfile, path: str | os.PathLike[str]) -> None:
    """Write atomically (temp file + rename) so a reader never sees half a profile."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")
    os.replace(tmp, target)


def load_profile(path: str | os.PathLike[str]) -> PerfProfile:
    return profile_from_dict(json.loads(Path(path).read_text()))
