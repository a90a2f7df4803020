"""The perf model as the policies' ``Predictor`` (tandem.policy.types)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tandem.engine.config import ModelConfig
from tandem.perf.hardware import hardware_preset
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape
from tandem.perf.profile import load_profile
from tandem.policy.types import Predictor, log_step, spread_pair_slopes


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


# How much faster than the base model's a larger timed prompt's part may grow over a smaller
# one's before the pair is taken as disturbed (``plausible_anchors``).
ANCHOR_GROWTH_SLACK = 1.5


def plausible_anchors(anchors: Sequence[tuple[float, float]]) -> bool:
    """Whether prompt parts timed at start-up, each (base model's prompt part, measured), can be
    a machine's: a larger prompt's part not shorter than a smaller one's (10 % of noise), nor
    growing more than ANCHOR_GROWTH_SLACK times as fast as the base model's (which is about
    linear in tokens). decode_svc times them beside whatever else runs on its cores: restarted
    during a soak, beside the other model's decode service packing its weights, one timed 32
    and 256 tokens at 523 and 63 ms, another at 88 and 4222 ms (29 and 87 ms on idle cores), and
    a line through such points predicts every later hybrid step of that service wrong."""
    ordered = sorted(anchors)
    for (base_small, small), (base_large, large) in zip(ordered, ordered[1:]):
        if base_large <= base_small:
            continue
        if large < 0.9 * small or large > small * ANCHOR_GROWTH_SLACK * base_large / base_small:
            return False
    return True


class LiveStepPredictor:
    """A predictor whose decode and hybrid steps are scaled by what it measured live.

    The default stack runs without a profile, on the placeholder preset, and a live step also
    pays what no profile sees (sampling, streaming, the other processes on the same cores). So
    the agent feeds every step decode reports (``observe``: its measured time, the prompt
    tokens it carried in chunks, the contexts it decoded). A decode-only step's measured /
    predicted ratio moves ``factor``, which scales decode steps. A step with prompt tokens
    (hybrid) is predicted as its decode part x ``factor`` plus a prompt part fitted to the
    hybrid steps measured: ``prompt_margin`` x (``prompt_fixed_s`` + ``prompt_factor`` x the base
    model's prompt part).

    The decode and prompt parts must be apart: on this CPU a decode step of a few rows runs
    whole in C on the Q4 weights (0.8-0.9x the base model with repacked layers), while prompt
    rows run fbgemm's fp16 (1.5-2x it). Decode-only steps outnumber hybrid ones 10-20 to 1, so
    one shared factor sat at the decode steps' ratio and 85 % of the hybrid steps of a ShareGPT
    run outran their prediction, past the TBT SLO the chunk budget was sized for (docs/engine.md, "the
    chunk budget").

    The prompt part is affine, not one flat factor, because a hybrid step pays a fixed cost for
    carrying a prompt at all: on the AMX host a 16-token chunk ran 0.9x the base model's prompt
    part, chunks of 83-112 tokens 0.5-0.8x, a step of 16 prompts of 127 tokens 0.46-0.72x. One
    factor fitted on the TBT-sized chunks a wave is cut into then predicted a step of the whole
    wave at twice what it took, and chunked's TTFT rule (``ttft_token_budget``) never gave it
    one. The line is a least-squares fit on the relative error. Given ``anchor`` steps (prompts
    of a few sizes decode_svc times at start-up), it goes through them, and the live hybrid
    steps move it (a live step pays what the start-up did not), or replace it once they span
    sizes (``_fit_prompt``). Without, it is fitted on the last ``window`` hybrid steps (each step's prompt part:
    what it took beyond its decode part at ``factor``); with fewer than three steps, or sizes
    within 1.5x of each other, it is one factor (their median ratio). Fitted on a narrow range
    of sizes the slope is loose, so it is then kept at least half that median ratio: a larger
    step is never predicted at less than half the flat rate.

    Both lean slow, so that a policy that fills a step up to the TBT SLO leaves room for the
    noise of the steps: a decode step slower than ``factor`` moves it by ``up`` toward its ratio,
    a faster one by ``down``, so it tracks an upper quantile of the ratio rather than its mean;
    ``prompt_margin`` settles where ``prompt_quantile`` of hybrid steps finish within their
    prediction (a quantile tracker taking steps of ``prompt_step`` in log space). The quantile
    is high (0.97) because one hybrid step that outruns the TBT SLO costs every stream beside
    it, and a request's TBT p99 over 64-128 gaps is nearly its largest gap: at 0.9, about one
    hybrid step in 30 ran past the SLO at 32 streams and 6 req/s on the 2-core host, and in
    some runs 18-78 % of the admitted requests missed TBT alone (docs/benchmarks.md, "A hybrid step past the
    SLO costs every stream"). A slower step moves ``factor`` as one ``max_jump`` (2) times the
    factor would, however slow it was. A step the host stalled (decode stopped for 1.3 s at 16
    streams, ``bench/admission_stall.py``) measures tens of times its prediction, and folded whole
    (its ratio clamped at ``max_factor`` only) it lifted the factor 2-3x at once. In such a trial
    a prompt then waited 5.4 s for its first token beside 15 streams and admission refused 73 of
    96 requests (the agent's factor was not logged: the chunk budget a 2-3x factor leaves beside
    15 streams is the inferred link). A machine that really slowed moves it 1.23x a step, so 3x
    within six steps.
    Prefill predictions are the base model's (the router calibrates its own).
    Not thread-safe.
    """

    def __init__(self, base: Predictor, *, up: float = 0.3, down: float = 0.05, min_factor: float = 0.1,
                 max_factor: float = 10.0, prompt_quantile: float = 0.97, prompt_step: float = 0.2,
                 window: int = 64, max_jump: float = 2.0) -> None:
        if not (0 < down <= up <= 1 and 0 < min_factor <= 1 <= max_factor and max_jump > 1):
            raise ValueError("LiveStepPredictor needs 0 < down <= up <= 1, min_factor <= 1 <= max_factor and "
                             "max_jump > 1")
        self.base = base
        self.max_jump = max_jump
        if not (0 < prompt_quantile < 1 and prompt_step > 0 and window >= 1):
            raise ValueError("LiveStepPredictor needs 0 < prompt_quantile < 1, prompt_step > 0 and window >= 1")
        self.up, self.down, self.min_factor, self.max_factor = up, down, min_factor, max_factor
        self.prompt_quantile, self.prompt_step = prompt_quantile, prompt_step
        self.factor = 1.0
        self.num_samples = 0  # decode-only steps folded into ``factor``
        self.prompt_fixed_s = 0.0
        self.prompt_factor = 1.0
        self.prompt_margin = 1.0
        self.num_prompt_samples = 0  # hybrid steps measured
        # (measured s, base decode part, base prompt part) of the last ``window`` hybrid steps
        self._hybrid: deque[tuple[float, float, float]] = deque(maxlen=window)
        # (base prompt part, measured prompt part) of steps timed apart from the stream of steps
        self._anchors: list[tuple[float, float]] = []
        # (fixed, slope) through the anchors, when they span sizes enough to fit one
        self._anchor_line: tuple[float, float] | None = None
        # Decode steps of split decisions, beside a busy prefill: their own factor (``observe_split``).
        self.split_factor = 1.0
        self.num_split_samples = 0

    @property
    def anchored(self) -> bool:
        """Whether it holds start-up timings (``anchor``) to fit prompt parts on."""
        return bool(self._anchors)

    def observe(self, measured_s: float, chunk_tokens: int, context_lens: Sequence[int], units: int) -> float | None:
        """Fold in one measured step; returns its measured / predicted ratio, the prediction
        made before this step was folded in (None: not usable)."""
        if not (measured_s > 0 and math.isfinite(measured_s)) or units < 1 or not (context_lens or chunk_tokens):
            return None
        if not chunk_tokens:
            ratio = self._ratio(measured_s, self.base.predict_decode(context_lens, units))
            if ratio is not None:
                self.factor = self._fold(self.factor, ratio, self.num_samples)
                self.num_samples += 1
            return ratio
        decode_s, prompt_s = self._hybrid_parts([(chunk_tokens, 0)], context_lens, units)
        predicted = self.factor * decode_s + self._prompt_s(prompt_s)
        ratio = self._ratio(measured_s, predicted)
        if ratio is None or not prompt_s > 0:
            return ratio
        if self.num_prompt_samples:
            # A quantile tracker on the whole step (the step's size does not matter, only whether
            # it outran its prediction): it settles where ``prompt_quantile`` of hybrid steps
            # finish within the prediction. Folding ratios instead (as ``factor`` does) left 20-30 %
            # of them above it, and the chunk budget fills a hybrid step up to the TBT SLO.
            over = measured_s > predicted
            self.prompt_margin = self._clamp(self.prompt_margin * math.exp(
                self.prompt_step * (self.prompt_quantile - (not over))))
        self._hybrid.append((measured_s, decode_s, prompt_s))
        self._fit_prompt()
        self.num_prompt_samples += 1
        return ratio

    def anchor(self, steps: Sequence[tuple[float, float, Sequence[tuple[int, int]], Sequence[int], int]]) -> bool:
        """Fit the shape of prompt parts on steps timed apart from the live ones: each
        (prompt part measured, decode part measured, the prompt's (new, cached) tokens, the
        contexts decoded beside it, units). decode_svc times a few prompt sizes at start-up
        (``tandem.engine.runner.warm_up``): live chunks all have about the TBT
        budget's size, too narrow a range to tell a step's fixed cost from its per-token one.
        The live steps then move the line (``_fit_prompt``) and the margin. Until the first live decode-only step, the decode parts measured
        set ``factor`` (their median ratio to the base model; the live step replaces it).
        Replaces earlier anchors, unless the new prompt parts are implausible
        (``plausible_anchors``: timed while other processes held the cores), which are left
        out, keeping the earlier anchors (a restarted decode service's predecessor's) or the
        live fit: False then."""
        anchors = []
        decode_ratios = []
        for prompt_s, decode_s, seqs, contexts, units in steps:
            base_decode_s, base_prompt_s = self._hybrid_parts(seqs, contexts, units)
            if prompt_s > 0 and base_prompt_s > 0 and math.isfinite(prompt_s):
                anchors.append((base_prompt_s, prompt_s))
            if decode_s > 0 and math.isfinite(decode_s) and (ratio := self._ratio(decode_s, base_decode_s)):
                decode_ratios.append(ratio)
        if not plausible_anchors(anchors):
            return False  # the decode parts were timed in the same disturbed minute
        if decode_ratios and not self.num_samples:
            self.factor = statistics.median(decode_ratios)
        self._anchors = anchors
        xs = [x for x, _ in self._anchors]
        self._anchor_line = (self._affine(self._anchors, narrow_guard=False)
                             if len(xs) >= 2 and max(xs) >= 1.5 * min(xs) else None)
        self._fit_prompt()
        return True

    def _fit_prompt(self) -> None:
        """``prompt_fixed_s`` and ``prompt_factor``: the anchors' line, moved by the live steps;
        without anchors, fitted on the live steps.

        Live steps that span sizes (six or more, with as many pairs twice apart in size) give the
        line themselves, a Theil-Sen fit (robust to the steps a kernel build or a burst slowed): on
        the 2-core host, prompt steps of 460-2048 tokens ran at 1.3-1.5x their in-process time
        and about 0.6 ms a token, against 0.38 at start-up (the router and the clients share the
        cores while a wave arrives), which no lift of the start-up line's fixed part fits. Of
        about one size, three or more move the anchors' line: within the anchors' sizes their
        median excess lifts its fixed part (a live step pays what the start-up did not); larger,
        their median ratio scales the whole line (contention slows every token; they tell little
        of the fixed part). Lifting the fixed part by larger steps' excess put their per-token
        excess on every small chunk: the first wave of 16 prompts of 400 tokens in steps of
        400-980 lifted 28 ms to 153-159 ms, no chunk fitted the TBT SLO beside 9 streams, and
        prompts waited for the streams to end, then ran whole in 2048-token steps again
        (docs/results/chunked-slow-mode-1204.log)."""
        # each live step's prompt part: what it took beyond its decode part, at least the floor
        live = [(x, max(m - self.factor * d, self.min_factor * x)) for m, d, x in self._hybrid]
        if self._anchor_line is None:
            if live:
                fixed, slope = self._affine(live, narrow_guard=True)
                self.prompt_fixed_s, self.prompt_factor = max(0.0, fixed), slope
            return
        fixed, slope = self._anchor_line
        # Theil-Sen: the median slope over pairs of steps twice apart in size or more (a mixture
        # of many chunks and a few whole waves splits no better at any one size)
        slopes = [slope for slope, _ in spread_pair_slopes(live, 2.0)]
        if len(live) >= 6 and len(slopes) >= len(live):
            slope = self._clamp(statistics.median(slopes))
            fixed = statistics.median(y - slope * x for x, y in live)
        elif len(live) >= 3:  # fewer: a live step or two may still be building kernels
            if statistics.median(x for x, _ in live) <= max(x for x, _ in self._anchors):
                fixed += statistics.median(y - fixed - slope * x for x, y in live)
            else:
                scale = self._clamp(statistics.median(y / (fixed + slope * x) for x, y in live))
                fixed, slope = scale * fixed, min(scale * slope, self.max_factor)
        self.prompt_fixed_s, self.prompt_factor = max(0.0, fixed), slope

    def _affine(self, points: Sequence[tuple[float, float]], narrow_guard: bool) -> tuple[float, float]:
        """(fixed, slope) with y = fixed + slope x, least squares on the relative error, fixed
        >= 0; one factor (the median ratio) for fewer than three points or sizes within 1.5x of
        each other. With ``narrow_guard`` the slope stays at least half the median ratio."""
        xs, ys = [x for x, _ in points], [y for _, y in points]
        flat = self._clamp(statistics.median(y / x for x, y in points))
        if len(points) < (2 if not narrow_guard else 3) or max(xs) < 1.5 * min(xs):
            return 0.0, flat
        # minimise the sum of (fixed/y + slope x/y - 1)^2
        us, vs = [1 / y for y in ys], [x / y for x, y in points]
        suu, svv = sum(u * u for u in us), sum(v * v for v in vs)
        suv, su, sv = sum(u * v for u, v in zip(us, vs, strict=True)), sum(us), sum(vs)
        det = suu * svv - suv * suv
        fixed, slope = 0.0, sv / svv
        if det > 1e-12 * suu * svv:
            fixed, slope = (su * svv - sv * suv) / det, (suu * sv - suv * su) / det
            if fixed < 0:
                fixed, slope = 0.0, sv / svv
        floor = max(self.min_factor, flat / 2 if narrow_guard else 0.0)
        if slope < floor:
            slope = floor
            fixed = max(0.0, sum(u * (1 - slope * v) for u, v in zip(us, vs, strict=True)) / suu)
        return fixed, min(slope, self.max_factor)

    def _prompt_s(self, prompt_s: float) -> float:
        """The prompt part of a hybrid step whose base prompt part is ``prompt_s``: before any
        hybrid step was measured or anchored, at the decode steps' factor."""
        if not (self.num_prompt_samples or self._anchors):
            return self.factor * prompt_s
        if not prompt_s > 0:
            return 0.0
        return self.prompt_margin * (self.prompt_fixed_s + self.prompt_factor * prompt_s)

    def _hybrid_parts(self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int],
                      units: int) -> tuple[float, float]:
        """The base model's hybrid step as (its decode part, the rest: the prompt tokens' part)."""
        whole = self.base.predict_hybrid(prefill_seqs, decode_context_lens, units)
        decode_s = self.base.predict_decode(decode_context_lens, units) if decode_context_lens else 0.0
        decode_s = min(decode_s, whole)
        return decode_s, whole - decode_s

    def prompt_ratio(self, tokens: int, units: int) -> float:
        """A ``tokens``-token prompt chunk's part of a step, as predicted now, over the base
        model's (1.0 where the base predicts none): one number for how the prompt parts moved."""
        _, base_s = self._hybrid_parts([(tokens, 0)], (), units)
        return self._prompt_s(base_s) / base_s if base_s > 0 else 1.0

    def prompt_scale(self) -> str:
        """How prompt parts are predicted now, for the log."""
        if not (self.num_prompt_samples or self._anchors):
            return f"x{self.factor:.2f} (the decode steps' factor)"
        return (f"x{self.prompt_margin:.2f} ({self.prompt_fixed_s * 1e3:.1f} ms + x{self.prompt_factor:.2f} "
                f"the model)")

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
        return self._clamp(measured_s / predicted_s)

    def _clamp(self, factor: float) -> float:
        return min(self.max_factor, max(self.min_factor, factor))

    def _fold(self, factor: float, ratio: float, num_samples: int) -> float:
        """The first ratio, then a geometric step toward each later one (``up`` or ``down``),
        a slower one taken as at most ``max_jump`` x the factor: a step the host stalled is not
        a slower machine (see the class docstring)."""
        if num_samples == 0:
            return ratio
        if ratio > factor:
            return log_step(factor, min(ratio, self.max_jump * factor), self.up)
        return log_step(factor, ratio, self.down)

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        return self.base.predict_prefill(seqs, units)

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        return self.factor * self.base.predict_decode(context_lens, units)

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        decode_s, prompt_s = self._hybrid_parts(prefill_seqs, decode_context_lens, units)
        return self.factor * decode_s + self._prompt_s(prompt_s)

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        """The base model's contention; for decode beside a busy prefill, once split steps were
        measured, scaled so that ``predict_decode`` x this = the split-calibrated step."""
        guard = self.base.contention(my_units, other_units, phase)
        if phase == "decode" and other_units > 0 and self.num_split_samples:
            return guard * self.split_factor / self.factor
        return guard
