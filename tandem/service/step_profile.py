"""A window of a service's steps recorded by ``torch.profiler``, for finding where a slow step's
time goes (host launches, kernels, copies, waits) as vLLM's ``VLLM_TORCH_PROFILER_DIR`` does.

``--torch-profile-dir DIR --torch-profile-steps START:COUNT`` records steps START..START+COUNT-1
of the service (counted from its first) and writes one Chrome trace, gzipped, into DIR; view it
in Perfetto or ``chrome://tracing``. The recording costs time: only a short window is taken.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tandem.profile")


def parse_window(text: str) -> tuple[int, int]:
    """``"START:COUNT"`` → (START, COUNT); ``""`` → (0, 0), no window."""
    if not text:
        return 0, 0
    try:
        start, count = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--torch-profile-steps takes START:COUNT, got {text!r}") from None
    if start < 0 or count < 1:
        raise ValueError(f"--torch-profile-steps needs START >= 0 and COUNT >= 1, got {text!r}")
    return start, count


class StepProfiler:
    """Call ``before(step)`` and ``after(step)`` around each step, on the thread that runs it."""

    def __init__(self, out_dir: str, window: tuple[int, int], name: str) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        self.start, self.count = window
        self.name = name
        self._prof: Any = None
        self.done = self.out_dir is None or self.count == 0

    def before(self, step: int) -> None:
        if self.done or self._prof is not None or step != self.start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        try:
            prof.__enter__()
        except Exception as exc:
            log.warning("%s: the torch profiler did not start: %s", self.name, exc)
            self.done = True
            return
        self._prof = prof

    def after(self, step: int) -> None:
        if self._prof is None or step < self.start + self.count - 1:
            return
        prof, self._prof, self.done = self._prof, None, True
        prof.__exit__(None, None, None)
        assert self.out_dir is not None
        path = self.out_dir / f"{self.name}-{os.getpid()}-steps{self.start}-{self.start + self.count - 1}.pt.trace.json.gz"
        began = time.perf_counter()
        try:  # a profile is a diagnosis: its failure must not fail the step
            self.out_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=15)
        except Exception as exc:
            log.warning("%s: writing the torch profile to %s failed: %s", self.name, path, exc)
            return
        log.info("%s: torch profile of steps %d-%d written to %s (%.1f s); by %s:\n%s", self.name, self.start,
                 self.start + self.count - 1, path, time.perf_counter() - began, sort, table)
