"""Admission's calibration kept across restarts (router/calibration_cache.py): what a router
measured comes back whole in the next one, through the file it writes, and admits with the warm
margin from the first request; a file that cannot be read, or holds no calibration, is ignored
with a warning and nothing changes; ``tandem up`` keys its directory by what the calibration
depends on."""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import AdmissionController, PromptRegime
from router.calibration_cache import RESTORED_SAMPLES_MAX, CalibrationCache
from tandem.policy.admission import REASON_CROWDED, CrowdBias
from tandem.engine.model_cache import cache_file_stem
from tandem.launcher import _admission_cache, admission_cache_dir
from tandem.policy.types import Slo
from tests.unit.test_admission import TokenPredictor
from tests.unit.test_admission_rate_bound import SLO as RATE_SLO
from tests.unit.test_admission_rate_bound import _beside_one_stream

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


_CALIBRATION = {"version": 1, "all": {"factor": 2.0, "num_samples": 3, "slope": 1.0, "overhead_s": 0.0,
                                      "recent": [[1.0, 2.0]]}, "regimes": []}


@pytest.mark.parametrize("outcomes", [{"rate_bound": ["0.5"]}, {"rate_bound": [0.1, float("nan")]},
                                      {"rate_bound": {"ratios": [0.1]}}, {"rate_bound": [0.1, True]},
                                      {"crowd": [[0.1]] * (len(CrowdBias.BOUNDS) + 2)}, {"crowd": [0.1, 0.2]},
                                      {"crowd": [[0.1], [float("inf")], [], [], []]},
                                      {"crowd": [[]] * 5, "rate_bound": None}])
def test_a_file_whose_outcomes_beside_streams_are_not_is_ignored_whole(
        tmp_path: Path, outcomes: dict[str, object], caplog: pytest.LogCaptureFixture) -> None:
    """A calibration that holds crowd or rate-bound outcomes that are not lists of finite log
    ratios (one per stream bucket for the crowd) is ignored whole, with a warning: nothing of it
    is restored, and the router starts cold."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**_CALIBRATION, **outcomes}))
    with caplog.at_level(logging.WARNING, logger="tandem.router.admission"):
        c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, cache=CalibrationCache(path))
    assert not c.calibration.calibrated and c.rate_bound.factor() is None and c.crowd.state() == [[]] * 5
    assert "ignoring the cached calibration" in caplog.text


def test_a_file_written_before_the_outcomes_were_kept_restores_its_calibration(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_CALIBRATION))
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, cache=CalibrationCache(path))
    assert c.calibration.calibrated and c.calibration.factor == pytest.approx(2.0)
    assert c.rate_bound.factor() is None and all(c.crowd.factor(n) == 1.0 for n in (0, 20, 100))


def _median(log_ratios: list[float]) -> float:
    return math.exp(statistics.median(log_ratios))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6), st.integers(0, 150), st.integers(0, 90), st.floats(0.1, 4.0))
def test_a_restored_router_starts_from_the_last_outcomes_beside_streams(
        tmp_path_factory: pytest.TempPathFactory, seed: int, num_batches: int, num_crowd: int, num_bound: int,
        live_ratio: float) -> None:
    """Random outcomes of prompts admitted beside streams, at random stream counts: the router
    restored from the file has the crowd factor at every stream count, and the rate bound, of the
    last ``min_outcomes`` outcomes of each (per bucket for the crowd), from its first prompt;
    none where fewer were seen. It goes on learning: ``min_outcomes`` + 1 live outcomes of one
    ratio make that ratio the rate bound's factor and the crowd's in that bucket."""
    rng = random.Random(seed)
    before = _measured(seed, num_batches)
    crowd_logs: list[list[float]] = [[] for _ in range(len(CrowdBias.BOUNDS) + 1)]
    for _ in range(num_crowd):
        in_flight, predicted_s, measured_s = rng.randint(0, 100), rng.uniform(0.05, 3.0), rng.uniform(0.05, 6.0)
        before.crowd.observe(in_flight, predicted_s, measured_s)
        crowd_logs[CrowdBias.bucket(in_flight)].append(math.log(measured_s / predicted_s))
    bound_logs = []
    for _ in range(num_bound):
        bound_s, measured_s = rng.uniform(0.05, 10.0), rng.uniform(0.05, 10.0)
        before.rate_bound.observe(bound_s, measured_s)
        bound_logs.append(math.log(measured_s / bound_s))
    cache = CalibrationCache(tmp_path_factory.mktemp("cache") / "m.json")
    before.cache = cache
    assert before.save_calibration()
    after = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, cache=cache)
    keep = after.rate_bound.min_outcomes
    if num_bound >= keep:
        assert after.rate_bound.factor() == pytest.approx(_median(bound_logs[-keep:]), rel=1e-9)
    else:
        assert after.rate_bound.factor() is None
    keep = after.crowd.min_outcomes
    for in_flight in (0, 7, 8, 15, 16, 40, 63, 64, 300):
        medians = [_median(logs[-keep:]) for logs in crowd_logs[:CrowdBias.bucket(in_flight) + 1] if len(logs) >= keep]
        expected = min(after.crowd.max_factor, max([1.0, *medians]))
        assert after.crowd.factor(in_flight) == pytest.approx(expected, rel=1e-9)
    for _ in range(after.rate_bound.min_outcomes + 1):
        after.rate_bound.observe(1.0, live_ratio)
    assert after.rate_bound.factor() == pytest.approx(live_ratio, rel=1e-9)
    for _ in range(after.crowd.min_outcomes + 1):
        after.crowd.observe(0, 1.0, live_ratio)
    assert after.crowd.factor(0) == pytest.approx(min(after.crowd.max_factor, max(1.0, live_ratio)), rel=1e-9)


def test_outcomes_beside_streams_alone_are_written(tmp_path: Path) -> None:
    """A router that measured no prefill batch since it last wrote, but saw prompts beside streams
    get their first tokens, writes again (what it learnt from them is part of the file)."""
    c = _measured(5, 3)
    c.cache = CalibrationCache(tmp_path / "m.json")
    assert c.save_calibration() and not c.save_calibration()
    c.rate_bound.observe(1.0, 0.5)
    assert c.save_calibration() and not c.save_calibration()
    c.crowd.observe(20, 1.0, 1.7)
    assert c.save_calibration()
    assert json.loads((tmp_path / "m.json").read_text())["crowd"][CrowdBias.bucket(20)] == [pytest.approx(math.log(1.7))]


@pytest.mark.parametrize("factor", [0.3, 0.6, 1.2])
def test_a_restored_rate_bound_refuses_from_the_first_prompt_beside_streams(tmp_path: Path, factor: float) -> None:
    """Beside one stream at 100 prompt tokens a second, a prompt ``factor`` x its time at that rate
    past the 2 s SLO: the router restored from one that learnt ``factor`` refuses it for the
    streams at once; a cold one (no bound learnt) admits it, as it did before the outcomes were
    kept."""
    learnt = _beside_one_stream(100.0, cache=CalibrationCache(tmp_path / "m.json"))
    for _ in range(learnt.rate_bound.min_outcomes):
        learnt.rate_bound.observe(1.0, factor)
    learnt._observe(PromptRegime(2), 1.0, 1.0)
    assert learnt.save_calibration()
    tokens = round(1.5 * 100.0 * RATE_SLO.ttft_s / factor)
    warm = _beside_one_stream(100.0, cache=CalibrationCache(tmp_path / "m.json"))
    refusal = warm.try_admit("p", tokens, now_s=1.0)
    assert refusal is not None and refusal.reason == REASON_CROWDED
    assert refusal.predicted_ttft_s == pytest.approx(factor * tokens / 100.0)
    assert _beside_one_stream(100.0).try_admit("p", tokens, now_s=1.0) is None


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
