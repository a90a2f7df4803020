"""Admission's prefill calibration kept across restarts: measured once, then cached.

Until admission has measured a prefill batch, it predicts from the perf model alone (the CPU
placeholder when no profile was given) and refuses only past the cold margin (2x the TTFT SLO).
That model can be far from the host: on 2026-12-04 it predicted 4.0 s for a wave of 29 chats
that took 1.3 s, and the cold router of `bench/admission.py` refused 19 of its first 32 requests,
all of which the stack without admission served within the SLO. A router that learnt the
calibration on this host before has no reason to start from the placeholder again. So the router
writes its calibration (``AdmissionController.calibration_state``: the factor over all batches
and each regime's, with the recent measurements their affine fits come from) to a JSON file
while it serves and when it stops, and a router started with the same file reads it back and
admits with the warm margin from its first request. The calibration keeps learning from live
batches as before, so a file from another hour of the same host is corrected as the first
batches come.

The router's ``--admission-cache DIR`` keeps one file per served model there. ``tandem up`` gives
it ``<cache root>/admission/<key>/``, the key a hash of what the calibration depends on: the CPU,
its core count, the weight format and KV dtype, the device and dtype, the perf profile (the
calibration corrects its predictions) and the models
(``tandem.launcher.admission_cache_dir``); its ``--admission-cache off`` turns it off. A file that
cannot be read or does not fit is logged and ignored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.policy.admission import PrefillCalibration

log = logging.getLogger("tandem.router.admission")

CACHE_VERSION = 1
# How many of its measurements a restored calibration counts, at most: the first live batches
# move a calibration by 1/n while it has few samples (a faster batch; PrefillCalibration.observe),
# so a restored one keeps that much room to follow the host of the hour.
RESTORED_SAMPLES_MAX = 4


def calibration_to_json(calibration: PrefillCalibration) -> dict[str, Any]:
    return {"factor": calibration.factor, "num_samples": calibration.num_samples, "slope": calibration.slope,
            "overhead_s": calibration.overhead_s, "recent": [list(pair) for pair in calibration.recent]}


def calibration_from_json(data: dict[str, Any], base: PrefillCalibration) -> PrefillCalibration:
    """``base`` (its weights and bounds) with the measured state of ``data``; ValueError when
    ``data`` does not hold one."""
    try:
        recent = tuple((float(p), float(m)) for p, m in data["recent"])
        restored = replace(base, factor=float(data["factor"]), slope=float(data["slope"]),
                           overhead_s=float(data["overhead_s"]), recent=recent[-base.max_recent:],
                           num_samples=min(int(data["num_samples"]), RESTORED_SAMPLES_MAX))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a calibration: {exc!r}") from None
    if restored.num_samples < 1 or not all(p > 0 and m > 0 for p, m in restored.recent):
        raise ValueError("a calibration without measurements")
    return restored


class CalibrationCache:
    """One model's calibration file (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Any] | None:
        """The state saved last, or None (no file, or one that cannot be read: logged)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("admission: ignoring the cached calibration %s: %s", self.path, exc)
            return None
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            log.warning("admission: ignoring the cached calibration %s: not version %d", self.path, CACHE_VERSION)
            return None
        return data

    def save(self, state: dict[str, Any]) -> None:
        """Write ``state`` whole or not at all (a temporary file renamed over the old one); a
        failure is logged, never raised: serving goes on without the cache."""
        tmp_name = ""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=f".{self.path.name}.",
                                             delete=False) as tmp:
                tmp_name = tmp.name
                json.dump({"version": CACHE_VERSION, **state}, tmp, indent=1)
            os.replace(tmp_name, self.path)
        except OSError as exc:
            log.warning("admission: could not save the calibration to %s: %s", self.path, exc)
            if tmp_name:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name)
