"""The perf model as the policies' ``Predictor`` (tandem.policy.types)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tandem.engine.config import ModelConfig
from tandem.perf.hardware import hardware_preset
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape
from tandem.perf.profile import load_profile
from tandem.policy.types import Predictor


class PerfPredictor:
    """Adapts ``PerfModel`` (keyword ``other_units``) to the policies' positional protocol."""

    def __init__(self, model: PerfModel) -> None:
        self.model = model

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        return self.model.predict_prefill(seqs, units)

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        return self.model.predict_decode(context_lens, units)

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        return self.model.predict_hybrid(prefill_seqs, decode_context_lens, units)

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        guard = self.model.contention
        return guard.lookup(phase, my_units, other_units) if guard is not None and other_units else 1.0


def cpu_predictor(model_config: ModelConfig, num_cores: int, profile_path: str | Path | None = None) -> PerfPredictor:
    """A predictor for this CPU: from a ``tandem profile`` file when given, else the placeholder
    preset resized to ``num_cores`` (coarse, but monotone, which is all the policies rely on)."""
    shape = ModelShape.from_config(model_config)
    if profile_path:
        profile = load_profile(profile_path)
        return PerfPredictor(PerfModel(profile.hardware, shape, profile.calibration(), profile.contention))
    hardware = hardware_preset("cpu")
    hardware = replace(hardware, num_units=num_cores, bandwidth_knee_units=min(hardware.bandwidth_knee_units, num_cores))
    return PerfPredictor(PerfModel(hardware, shape))


class LiveStepPredictor:
    """A predictor whose decode and hybrid steps are scaled by a factor measured live.

    The default stack runs without a profile, on the placeholder preset, and a live step also
    pays what no profile sees (sampling, streaming, the other processes on the same cores). So
    the agent feeds every step decode reports (``observe``: its measured time, the prompt
    tokens it carried in chunks, the contexts it decoded) and the factor follows measured /
    predicted. It leans slow: a step slower than the factor moves it by ``up``, a faster one by
    ``down``, so it tracks an upper quantile of the ratio rather than its mean, and a policy
    that fills a step up to the TBT SLO leaves room for the noise of the steps. Prefill
    predictions are the base model's (the router calibrates its own). Not thread-safe.
    """

    def __init__(self, base: Predictor, *, up: float = 0.3, down: float = 0.05, min_factor: float = 0.1,
                 max_factor: float = 10.0) -> None:
        if not (0 < down <= up <= 1 and 0 < min_factor <= 1 <= max_factor):
            raise ValueError("LiveStepPredictor needs 0 < down <= up <= 1 and min_factor <= 1 <= max_factor")
        self.base = base
        self.up, self.down, self.min_factor, self.max_factor = up, down, min_factor, max_factor
        self.factor = 1.0
        self.num_samples = 0
        # Decode steps of split decisions, beside a busy prefill: their own factor (``observe_split``).
        self.split_factor = 1.0
        self.num_split_samples = 0

    def observe(self, measured_s: float, chunk_tokens: int, context_lens: Sequence[int], units: int) -> float | None:
        """Fold in one measured step; returns its measured / predicted ratio (None: not usable)."""
        if not (measured_s > 0 and math.isfinite(measured_s)) or units < 1 or not (context_lens or chunk_tokens):
            return None
        if chunk_tokens:
            predicted = self.base.predict_hybrid([(chunk_tokens, 0)], context_lens, units)
        else:
            predicted = self.base.predict_decode(context_lens, units)
        ratio = self._ratio(measured_s, predicted)
        if ratio is not None:
            self.factor = self._fold(self.factor, ratio, self.num_samples)
            self.num_samples += 1
        return ratio

    def observe_split(self, measured_s: float, context_lens: Sequence[int], decode_units: int,
                      prefill_units: int) -> float | None:
        """Fold in a decode step of a split decision, run on ``decode_units`` while prefill ran
        on ``prefill_units``: it scales the predicted decode step beside prefill (its contention),
        which the split policies size decode's share by. On the H100, ``dynamic``'s decode ran
        2-4x the profile's time on its side of a split (fewer SMs than it asked for could not be
        given, prefill took the memory bandwidth), and only this measures that. Returns its
        measured / predicted ratio (None: not usable)."""
        if not (measured_s > 0 and math.isfinite(measured_s)) or decode_units < 1 or prefill_units < 1 \
                or not context_lens:
            return None
        predicted = self.base.predict_decode(context_lens, decode_units) * self.base.contention(
            decode_units, prefill_units)
        ratio = self._ratio(measured_s, predicted)
        if ratio is not None:
            self.split_factor = self._fold(self.split_factor, ratio, self.num_split_samples)
            self.num_split_samples += 1
        return ratio

    def _ratio(self, measured_s: float, predicted_s: float) -> float | None:
        """measured / predicted within [min_factor, max_factor]; None for no prediction."""
        if not predicted_s > 0:
            return None
        return min(self.max_factor, max(self.min_factor, measured_s / predicted_s))

    def _fold(self, factor: float, ratio: float, num_samples: int) -> float:
        """The first ratio, then a geometric step toward each later one (``up`` or ``down``)."""
        if num_samples == 0:
            return ratio
        w = self.up if ratio > factor else self.down
        return math.exp((1 - w) * math.log(factor) + w * math.log(ratio))

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        return self.base.predict_prefill(seqs, units)

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        return self.factor * self.base.predict_decode(context_lens, units)

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        return self.factor * self.base.predict_hybrid(prefill_seqs, decode_context_lens, units)

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        """The base model's contention; for decode beside a busy prefill, once split steps were
        measured, scaled so that ``predict_decode`` x this = the split-calibrated step."""
        guard = self.base.contention(my_units, other_units, phase)
        if phase == "decode" and other_units > 0 and self.num_split_samples:
            return guard * self.split_factor / self.factor
        return guard
