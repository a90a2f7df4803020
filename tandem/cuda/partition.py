"""SM partitions of one CUDA device: disjoint green contexts, one stream each.

``SmPartitions`` pre-creates, for each prefill SM count it offers, one pair of green contexts
that split the device's SMs between prefill and decode. The CUDA driver's
``cuDevSmResourceSplitByCount`` cuts a group of the asked count out of the device's SM resource
and returns the rest as the remainder, so the two contexts of a pair share no SM by
construction (``tests/gpu`` checks it with the SMs' own ids, ``tandem.cuda.smid``). The driver
rounds a group up to the device's granularity: SMs come in TPC pairs, and on compute capability
9.x groups are multiples of 8 (SGLang's pdmux asks for the same; MuxWise stepped by 16 on H100),
so the counts offered here are multiples of ``granularity``. Each context gets one non-blocking
stream; the whole device (one phase alone) is an ordinary stream.

A partition change is a change of the stream that a phase's next layer group or decode step is
launched on (``PhaseStream.switch``): an event recorded on the old stream and waited on by the
new one keeps that phase's work in order across the boundary, so a switch is a few host calls
and no device synchronisation. Work already launched finishes on the SMs it was launched on;
the next launch runs on the new ones. Contexts are created once (tens of ms each) and kept.

Documented driver API only (cuda-bindings' ``cuDeviceGetDevResource``,
``cuDevSmResourceSplitByCount``, ``cuDevResourceGenerateDesc``, ``cuGreenCtxCreate``,
``cuGreenCtxStreamCreate``); torch sees each stream through ``torch.cuda.ExternalStream``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

PHASES = ("prefill", "decode")
# The fewest SMs a service's phase is given on a split (see ``SmPartitions``).
SERVICE_MIN_SMS = 32
# The services' splits step by 16 SMs, as MuxWise's on an H100: a handful of splits (five on 132
# SMs), so decode's CUDA graphs, captured per stream, are captured on few streams.
SERVICE_SPLIT_STEP = 16


def sm_granularity(major: int) -> int:
    """The step of SM counts a green-context split honours: 8 on Hopper and later (compute
    capability >= 9), a TPC (2 SMs) before."""
    return 8 if major >= 9 else 2


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - CUDA machines only
        raise RuntimeError("SM partitions need the cuda-bindings package (pip install cuda-bindings)") from exc
    return driver


def _check(result: Any) -> Any:
    """Unwrap a cuda-bindings call's (CUresult, value...) tuple, raising on an error."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class Partition:
    """One split of the device: ``prefill_sms`` + ``decode_sms`` = the device's SMs (one side
    may be 0: the other phase alone, on the whole device)."""

    prefill_sms: int
    decode_sms: int
    prefill_stream: torch.cuda.Stream | None
    decode_stream: torch.cuda.Stream | None

    def stream(self, phase: str) -> torch.cuda.Stream:
        s = self.prefill_stream if phase == "prefill" else self.decode_stream
        if s is None:
            raise ValueError(f"partition {self.prefill_sms}/{self.decode_sms} gives {phase} no SMs")
        return s

    def sms(self, phase: str) -> int:
        return self.prefill_sms if phase == "prefill" else self.decode_sms


class SmPartitions:
    """Every prefill/decode split of one device that a policy may choose, made up front."""

    def __init__(self, device: int = 0, prefill_counts: Iterable[int] | None = None, min_sms: int = 0,
                 step: int | None = None) -> None:
        """``min_sms``: leave out the splits that give either side fewer SMs (the default counts
        only); ``step``: the default counts' step (``split_counts``). cuBLAS failed on this H100
        with CUBLAS_STATUS_EXECUTION_FAILED for bf16 GEMMs launched on a 12-SM green context,
        while 32 SMs and more ran every shape measured; the services ask for ``SERVICE_MIN_SMS``
        in steps of ``SERVICE_SPLIT_STEP``."""
        if not torch.cuda.is_available():
            raise RuntimeError("SM partitions need a CUDA device; none is visible")
        props = torch.cuda.get_device_properties(device)
        self.device = device
        self.total_sms: int = props.multi_processor_count
        self.granularity = sm_granularity(props.major)
        wanted = sorted(set(prefill_counts)) if prefill_counts is not None else [
            k for k in split_counts(self.total_sms, self.granularity, step) if min(k, self.total_sms - k) >= min_sms]
        for k in wanted:
            if k % self.granularity or not 0 < k < self.total_sms:
                raise ValueError(f"prefill SM count {k} must be a multiple of {self.granularity} in (0, {self.total_sms})")
        driver = _driver()
        torch.cuda.init()
        _check(driver.cuInit(0))
        self._cu_dev = _check(driver.cuDeviceGet(device))
        self._whole = _check(driver.cuDeviceGetDevResource(self._cu_dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        self._contexts: list[Any] = []
        self._streams: list[Any] = []
        self.partitions: dict[int, Partition] = {}
        whole_stream = torch.cuda.Stream(device)
        self.partitions[0] = Partition(0, self.total_sms, None, whole_stream)
        self.partitions[self.total_sms] = Partition(self.total_sms, 0, whole_stream, None)
        for k in wanted:
            groups, _, rest = _check(driver.cuDevSmResourceSplitByCount(1, self._whole, 0, k))
            group = groups[0]
            got, left = int(group.sm.smCount), int(rest.sm.smCount)
            self.partitions[k] = Partition(got, left, self._stream_for(group), self._stream_for(rest))

    def _stream_for(self, resource: Any) -> torch.cuda.Stream:
        driver = _driver()
        desc = _check(driver.cuDevResourceGenerateDesc([resource], 1))
        ctx = _check(driver.cuGreenCtxCreate(desc, self._cu_dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        raw = _check(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        self._contexts.append(ctx)
        self._streams.append(raw)
        return torch.cuda.ExternalStream(int(raw), device=self.device)

    @property
    def prefill_counts(self) -> list[int]:
        return sorted(self.partitions)

    def for_phase(self, phase: str, sms: int) -> Partition:
        """The split that gives ``phase`` the SM count nearest ``sms`` and at least one SM."""
        key = nearest_split({k: (p.prefill_sms, p.decode_sms) for k, p in self.partitions.items()}, phase, sms)
        return self.partitions[key]

    def close(self) -> None:
        """Destroy the streams and contexts (torch must not use the streams afterwards)."""
        driver = _driver()
        torch.cuda.synchronize(self.device)
        for raw in self._streams:
            _check(driver.cuStreamDestroy(raw))
        for ctx in self._contexts:
            _check(driver.cuGreenCtxDestroy(ctx))
        self._streams.clear()
        self._contexts.clear()
        self.partitions.clear()

    def __enter__(self) -> SmPartitions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PhaseStream:
    """Where one phase launches: its side of the partition in force. ``switch`` at a layer-group
    or step boundary; what was launched before stays ordered before what is launched after."""

    def __init__(self, phase: str, partition: Partition) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase = phase
        self.partition = partition
        self.stream = partition.stream(phase)
        self.switches = 0

    def switch(self, partition: Partition) -> torch.cuda.Stream:
        new = partition.stream(self.phase)
        if new is not self.stream:
            done = torch.cuda.Event()
            done.record(self.stream)
            new.wait_event(done)
            self.switches += 1
        self.partition, self.stream = partition, new
        return new


def split_counts(total_sms: int, granularity: int, step: int | None = None) -> Sequence[int]:
    """Prefill SM counts ``step, 2 step, ...`` below ``total_sms`` (``step`` defaults to the
    granularity; MuxWise's 16 on H100 is a coarser choice)."""
    step = step or granularity
    if step % granularity:
        raise ValueError(f"step {step} is not a multiple of the granularity {granularity}")
    return list(range(step, total_sms - granularity + 1, step))


def nearest_split(splits: dict[int, tuple[int, int]], phase: str, sms: int) -> int:
    """The key of the split (prefill SMs, decode SMs) that gives ``phase`` the count nearest
    ``sms`` among those that give it any (ties: the smaller count). A policy's unit count need
    not be an offered one: the whole device, a count under the fewest a split allows, or one
    between two steps all map to the closest split that still runs the phase."""
    side = 0 if phase == "prefill" else 1
    keys = [k for k, pair in splits.items() if pair[side] > 0]
    if not keys:
        raise ValueError(f"no split gives {phase} any SM")
    return min(keys, key=lambda k: (abs(splits[k][side] - sms), splits[k][side]))
