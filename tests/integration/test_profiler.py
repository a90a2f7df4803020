"""`tandem profile --quick` on a tiny model: the profile file it writes is complete and loads.

Accuracy is not asserted here (this machine is shared and noisy); it belongs in a benchmark.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import pytest

from tandem.engine.config import ModelConfig
from tandem.perf import profile_cli
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape
from tandem.perf.profile import load_profile
from tests.tiny_models import write_tiny_model


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem")
    profile_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_quick_profile_writes_a_complete_loadable_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny", "llama")
    out = tmp_path / "profile.json"
    affinity = os.sched_getaffinity(0)

    assert _run_cli(["profile", "--model", str(model_dir), "--out", str(out), "--quick"]) == 0

    captured = capsys.readouterr()
    assert "held-out error (MAPE) prefill" in captured.out
    assert captured.err.count("\n") >= 10  # one progress line per measurement
    assert os.sched_getaffinity(0) == affinity  # pinning is undone

    profile = load_profile(out)
    hw = profile.hardware
    assert hw.name == "cpu" and not hw.is_gpu
    assert hw.num_units == len(affinity)
    for value in (hw.peak_flops_per_unit, hw.mem_bandwidth, hw.bandwidth_knee_units, hw.op_overhead_s):
        assert math.isfinite(value) and value > 0
    num_cores = len(affinity)
    expected_units = tuple(u for u in (1, 2) if u <= num_cores)
    assert set(expected_units) <= set(profile.units)

    for phase in ("prefill", "decode"):
        for units in profile.units:
            samples = [s for s in profile.calibration_samples if s.phase == phase and s.units == units]
            assert len(samples) >= 2, (phase, units)
            assert all(math.isfinite(s.ratio) and s.ratio > 0 for s in samples)
        # Held-out shapes are measured but kept out of the fit, and their error is recorded.
        fit_tokens = {s.num_tokens for s in profile.calibration_samples if s.phase == phase}
        heldout = [s for s in profile.heldout_samples if s.phase == phase]
        assert heldout and not {s.num_tokens for s in heldout} & fit_tokens
        assert math.isfinite(profile.heldout_error[phase]) and profile.heldout_error[phase] >= 0

    calibration = profile.calibration()
    assert calibration.knots("prefill") and calibration.knots("decode")

    if num_cores >= 2:
        guard = profile.contention
        assert guard is not None
        for phase in ("prefill", "decode"):
            factor = guard.lookup(phase, 1, 1)
            assert math.isfinite(factor) and factor >= 1.0
    else:
        assert profile.contention is None
        assert any("contention not measured" in note for note in profile.notes)

    # The agent and router build their model from the profile; it predicts finite latencies.
    shape = ModelShape.from_config(ModelConfig.from_dir(model_dir), dtype_bytes=4)
    model = PerfModel(hw, shape, profile.calibration(), profile.contention)
    other = 1 if num_cores >= 2 else 0
    assert 0 < model.predict_prefill([(48, 0)], 1, other_units=other) < math.inf
    assert 0 < model.predict_decode([32] * 3, 1, other_units=other) < math.inf


def test_default_profile_path_uses_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = profile_cli.default_profile_path("SmolLM2-135M-Instruct")
    assert path.parent == tmp_path / "profiles"
    assert path.name.endswith("-SmolLM2-135M-Instruct.json")
