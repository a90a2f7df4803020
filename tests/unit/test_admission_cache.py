"""Admission's calibration kept across restarts (router/calibration_cache.py): what a router
measured comes back whole in the next one, through the file it writes, and admits with the warm
margin from the first request; a file that cannot be read, or holds no calibration, is ignored
with a warning and nothing changes; ``tandem up`` keys its directory by what the calibration
depends on."""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import AdmissionController, PromptRegime
from router.calibration_cache import RESTORED_SAMPLES_MAX, CalibrationCache
from tandem.engine.model_cache import cache_file_stem
from tandem.launcher import _admission_cache, admission_cache_dir
from tandem.policy.types import Slo
from tests.unit.test_admission import TokenPredictor

SLO = Slo(ttft_s=1.0, tbt_s=0.1)
REGIMES = [PromptRegime(1), PromptRegime(2), PromptRegime(2, beside_streams=True)]


def _measured(seed: int, num_batches: int) -> AdmissionController:
    """A controller that has folded in ``num_batches`` random batches in random regimes."""
    rng = random.Random(seed)
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2)
    for _ in range(num_batches):
        predicted = rng.uniform(0.01, 3.0)
        c._observe(rng.choice(REGIMES), predicted * rng.uniform(0.1, 4.0) + rng.choice([0.0, 0.05]), predicted)
    return c


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 40))
def test_a_restored_router_predicts_as_the_one_that_measured(tmp_path_factory: pytest.TempPathFactory,
                                                             seed: int, num_batches: int) -> None:
    before = _measured(seed, num_batches)
    cache = CalibrationCache(tmp_path_factory.mktemp("cache") / "m.json")
    before.cache = cache
    assert before.save_calibration()
    assert not before.save_calibration()  # nothing measured since
    after = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, cache=cache)
    for regime in [*REGIMES, PromptRegime(3)]:  # and one nobody measured: it borrows the overall factor
        assert after.scale(regime) == pytest.approx(before.scale(regime), rel=1e-12)
        assert after.scaling(regime) == pytest.approx(before.scaling(regime), rel=1e-12)
    assert after.calibration.num_samples == min(num_batches, RESTORED_SAMPLES_MAX)
    # It goes on learning from live batches as a calibration of that many samples would.
    after._observe(PromptRegime(2), 2.0, 1.0)
    assert after.calibration.num_samples == min(num_batches, RESTORED_SAMPLES_MAX) + 1


def test_the_restored_calibration_admits_with_the_warm_margin(tmp_path: Path) -> None:
    """Behind 9,000 prompt tokens on one unit (0.9 s by the model), 5,000 more come at 1.4 s
    against the 1 s SLO. Uncalibrated, the cold margin (2x) admits them; restored from a router
    that measured the model right on one unit, the warm margin (1.25x) refuses them, as that
    router would have."""
    cache = CalibrationCache(tmp_path / "m.json")
    measured = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1, cache=cache)
    for _ in range(3):
        measured._observe(PromptRegime(1), 0.5, 0.5)
    measured.save_calibration()
    cold = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1)
    warm = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1, cache=cache)
    assert warm.scale(1) == (pytest.approx(1.0), True) and cold.scale(1) == (1.0, False)
    for c in (cold, warm):
        assert c.try_admit("ahead", 9_000, now_s=10.0) is None
    assert cold.try_admit("r", 5_000, now_s=10.0) is None
    refusal = warm.try_admit("r", 5_000, now_s=10.0)
    assert refusal is not None and refusal.predicted_ttft_s == pytest.approx(1.4)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "all": {}}), json.dumps([1, 2]),
                                     json.dumps({"version": 1, "all": {"factor": 1.0}, "regimes": []}),
                                     json.dumps({"version": 1, "all": {"factor": 2.0, "num_samples": 0, "slope": 1.0,
                                                                       "overhead_s": 0.0, "recent": []},
                                                 "regimes": []}),
                                     json.dumps({"version": 1, "all": {"factor": -1.0, "num_samples": 3,
                                                                       "slope": 1.0, "overhead_s": 0.0,
                                                                       "recent": [[1.0, 1.0]]}, "regimes": []})])
def test_a_file_without_a_calibration_is_ignored(tmp_path: Path, content: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="tandem.router.admission"):
        c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, cache=CalibrationCache(path))
    assert not c.calibration.calibrated and not c.calibration_by_regime
    assert "ignoring the cached calibration" in caplog.text


def test_no_file_is_a_cold_start_and_a_failed_write_is_only_logged(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2,
                            cache=CalibrationCache(blocked / "m.json"))  # its directory is a file
    assert not c.calibration.calibrated
    c._observe(PromptRegime(2), 1.0, 2.0)
    with caplog.at_level(logging.WARNING, logger="tandem.router.admission"):
        assert c.save_calibration()
    assert "could not save the calibration" in caplog.text
    assert list(tmp_path.iterdir()) == [blocked]  # no temporary file left behind


def test_tandem_up_keys_the_directory_by_what_the_calibration_depends_on(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    one = admission_cache_dir(tmp_path, quantization="ggml", kv_dtype="", models=["a"])
    assert one == admission_cache_dir(tmp_path, quantization="ggml", kv_dtype="", models=["a"])
    assert one != admission_cache_dir(tmp_path, quantization="fp16", kv_dtype="", models=["a"])
    assert one != admission_cache_dir(tmp_path, quantization="ggml", kv_dtype="", models=["a", "b"])
    key = json.loads((one / "key.json").read_text())
    assert key["quantization"] == "ggml" and key["cpus"] >= 1 and key["cpu"]
    args = argparse.Namespace(admission_cache="off")
    assert _admission_cache(args, []) == ""
    args.admission_cache = str(tmp_path / "mine")
    assert _admission_cache(args, []) == str(tmp_path / "mine")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "root"))
    args = argparse.Namespace(admission_cache="auto", quantization="ggml", kv_dtype="", device="cpu", dtype="auto",
                              profile="")
    placeholder = Path(_admission_cache(args, []))
    assert placeholder.parent == tmp_path / "root" / "admission"
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    args.profile = str(profile)
    assert Path(_admission_cache(args, [])) not in (placeholder, one)
    profile.write_text('{"other": 1}')  # another profile at the same path: another calibration
    assert len({Path(_admission_cache(args, [])), placeholder}) == 2 and len(list((tmp_path / "root" / "admission").iterdir())) == 3


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_a_served_name_becomes_one_plain_file_name(name: str) -> None:
    """The router's cache file and the profile's are named by ``cache_file_stem``: any served
    name (a slash, unicode, nothing at all) gives a plain ASCII name inside the directory, and a
    name that is one already is kept."""
    stem = cache_file_stem(name)
    assert stem and all(c.isascii() and (c.isalnum() or c in "._-") for c in stem)
    assert cache_file_stem(stem) == stem and Path(f"{stem}.json").name == f"{stem}.json"
    if name and all(c.isascii() and (c.isalnum() or c in "._-") for c in name):
        assert stem == name
