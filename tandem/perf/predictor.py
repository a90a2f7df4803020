"""The perf model as the policies' ``Predictor`` (tandem.policy.types)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tandem.engine.config import ModelConfig
from tandem.perf.hardware import hardware_preset
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape
from tandem.perf.profile import load_profile


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
