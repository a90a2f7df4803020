"""KV memory under a shifting two-model mix: one slab pool vs one static pool per model.

Two Llama-3.1-8B variants share one GPU's KV memory: model A keeps an fp16 KV (2 MiB per
16-token block), model B an int8 KV with an fp16 scale per token and KV head (FineServe's
Quant.Params: 1 MiB + 16 KiB per block), so the slab is their LCM (130 MiB). Requests arrive
Poisson with ShareGPT lengths; the mix shifts A-heavy -> even -> B-heavy in three equal phases.
A request takes blocks for its prompt and output on arrival (the output length is known, as
with ignore_eos) and holds them for output_len decode steps; a request that finds too few
blocks is refused. The same arrivals go to each layout:

- ``slab``: one ``KVSlabPool`` with a ``SlabBlockAllocator`` per model (tandem.engine.kv_slab);
- ``static``: two pools of half the bytes each, one ``BlockAllocator`` per model;
- ``uniform``: one shared pool with one block size for both (A's 2 MiB): B's block then holds
  31 tokens, the internal fragmentation FineServe's C2 describes.

Reported per layout: tokens cached per MiB of KV (time average), requests refused (per model and
phase), internal fragmentation (bytes of held blocks not holding a token, over held bytes, time
average) and external fragmentation at each refusal (free bytes the refused model could not
use, over the pool). Pure Python, a few seconds. Writes docs/results/kv-slab-fragmentation.json.

    .venv/bin/python bench/kv_slab.py [--pool-gib 4] [--rate 40] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from tandem.bench.workload import LENGTH_MODELS
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.errors import OutOfBlocksError
from tandem.engine.kv_slab import KVSlabPool, kv_block_bytes

MIB = 1 << 20
BLOCK_TOKENS = 16
# Llama-3.1-8B: 32 layers, 8 KV heads of 128.
A_TOKEN_BYTES = 32 * 2 * 8 * 128 * 2
A_BLOCK = kv_block_bytes(32, 8, 128, BLOCK_TOKENS, 2)
# Model B's KV format: FineServe's W8A8KV8 (fp8 values, one scale per tensor: 1 MiB blocks, the
# LCM with A's is A's 2 MiB), or int8 with an fp16 scale per token and KV head (1 MiB + 16 KiB,
# the LCM is 130 MiB).
B_SCALES = {"fp8": 0, "int8-scales": 32 * 2 * 8 * 2}
B_TOKEN_BYTES = 0
B_BLOCK = 0
TOKEN_BYTES = {"A": A_TOKEN_BYTES, "B": 0}


def set_b_format(name: str) -> None:
    """Select model B's KV format for the layouts below (module-level: one format per run)."""
    global B_TOKEN_BYTES, B_BLOCK
    B_TOKEN_BYTES = 32 * 2 * 8 * 128 + B_SCALES[name]
    B_BLOCK = kv_block_bytes(32, 8, 128, BLOCK_TOKENS, 1, scale_bytes_per_token=B_SCALES[name])
    TOKEN_BYTES["B"] = B_TOKEN_BYTES
PHASE_SHARE_A = (0.8, 0.5, 0.2)


class Layout(Protocol):
    pool_bytes: int

    def allocate(self, model: str, num_tokens: int) -> list[int] | None: ...
    def free(self, model: str, block_ids: list[int]) -> None: ...
    def block_bytes(self, model: str) -> int: ...
    def tokens_per_block(self, model: str) -> int: ...
    def usable_free_bytes(self, model: str) -> int: ...
    def free_bytes(self) -> int: ...


class SlabLayout:
    def __init__(self, pool_bytes: int) -> None:
        self.pool = KVSlabPool(pool_bytes, {"A": A_BLOCK, "B": B_BLOCK})
        self.pool_bytes = pool_bytes
        self.views = {m: self.pool.view(m, BLOCK_TOKENS) for m in ("A", "B")}

    def allocate(self, model: str, num_tokens: int) -> list[int] | None:
        try:
            return self.views[model].extend([], num_tokens)
        except OutOfBlocksError:
            return None

    def free(self, model: str, block_ids: list[int]) -> None:
        self.views[model].free(block_ids)

    def block_bytes(self, model: str) -> int:
        return self.pool.block_bytes[model]

    def tokens_per_block(self, model: str) -> int:
        return BLOCK_TOKENS

    def usable_free_bytes(self, model: str) -> int:
        return self.views[model].num_free_blocks * self.block_bytes(model)

    def free_bytes(self) -> int:
        held = sum(v.num_used_blocks * self.block_bytes(m) for m, v in self.views.items())
        return self.pool_bytes - held


class StaticLayout:
    """One BlockAllocator per model over its own share of the bytes."""

    def __init__(self, pool_bytes: int, share_a: float = 0.5) -> None:
        self.pool_bytes = pool_bytes
        self._bytes = {"A": A_BLOCK, "B": B_BLOCK}
        part = {"A": int(pool_bytes * share_a), "B": pool_bytes - int(pool_bytes * share_a)}
        self.allocs = {m: BlockAllocator(part[m] // self._bytes[m], BLOCK_TOKENS) for m in ("A", "B")}

    def allocate(self, model: str, num_tokens: int) -> list[int] | None:
        alloc = self.allocs[model]
        if not alloc.can_extend([], num_tokens):
            return None
        return alloc.extend([], num_tokens)

    def free(self, model: str, block_ids: list[int]) -> None:
        self.allocs[model].free(block_ids)

    def block_bytes(self, model: str) -> int:
        return self._bytes[model]

    def tokens_per_block(self, model: str) -> int:
        return BLOCK_TOKENS

    def usable_free_bytes(self, model: str) -> int:
        return self.allocs[model].num_free_blocks * self._bytes[model]

    def free_bytes(self) -> int:
        return self.pool_bytes - sum(a.num_used_blocks * self._bytes[m] for m, a in self.allocs.items())


class UniformLayout:
    """One shared pool of A-sized blocks; B packs as many of its tokens as fit in one."""

    def __init__(self, pool_bytes: int) -> None:
        self.pool_bytes = pool_bytes
        self.alloc = BlockAllocator(pool_bytes // A_BLOCK, 1)
        self._tokens = {"A": BLOCK_TOKENS, "B": A_BLOCK // B_TOKEN_BYTES}

    def allocate(self, model: str, num_tokens: int) -> list[int] | None:
        num_blocks = -(-num_tokens // self._tokens[model])
        if not self.alloc.can_extend([], num_blocks):
            return None
        return self.alloc.extend([], num_blocks)

    def free(self, model: str, block_ids: list[int]) -> None:
        self.alloc.free(block_ids)

    def block_bytes(self, model: str) -> int:
        return A_BLOCK

    def tokens_per_block(self, model: str) -> int:
        return self._tokens[model]

    def usable_free_bytes(self, model: str) -> int:
        return self.alloc.num_free_blocks * A_BLOCK

    def free_bytes(self) -> int:
        return self.pool_bytes - self.alloc.num_used_blocks * A_BLOCK


@dataclass
class Request:
    arrival_s: float
    model: str
    phase: int
    num_tokens: int
    hold_s: float


@dataclass
class Stats:
    refused: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    refused_by_phase: list[int] = field(default_factory=lambda: [0, 0, 0])
    served: int = 0
    token_seconds: float = 0.0
    byte_seconds_held: float = 0.0
    byte_seconds_tokens: float = 0.0
    external_at_refusal: list[float] = field(default_factory=list)


def build_workload(seed: int, rate_rps: float, duration_s: float, tpot_s: float) -> list[Request]:
    rng = np.random.default_rng(seed)
    num = int(rate_rps * duration_s * 1.2) + 10
    gaps = rng.exponential(1.0 / rate_rps, size=num)
    times = np.cumsum(gaps)
    inputs, outputs = LENGTH_MODELS["sharegpt"].sample(rng, num, 4096, 1024)
    coins = rng.random(num)
    out: list[Request] = []
    for t, i, o, c in zip(times, inputs, outputs, coins):
        if t >= duration_s:
            break
        phase = min(2, int(3 * t / duration_s))
        model = "A" if c < PHASE_SHARE_A[phase] else "B"
        out.append(Request(float(t), model, phase, i + o, o * tpot_s))
    return out


def run(layout: Layout, requests: list[Request], duration_s: float) -> Stats:
    stats = Stats()
    held: list[tuple[float, int, str, list[int], int]] = []  # (release time, seq, model, blocks, tokens)
    tokens_now = 0
    held_bytes = 0
    token_bytes = 0
    last_t = 0.0

    def advance(t: float) -> None:
        nonlocal last_t
        dt = t - last_t
        stats.token_seconds += tokens_now * dt
        stats.byte_seconds_held += held_bytes * dt
        stats.byte_seconds_tokens += token_bytes * dt
        last_t = t

    seq = 0
    for r in requests:
        while held and held[0][0] <= r.arrival_s:
            t, _, model, blocks, n = heapq.heappop(held)
            advance(t)
            layout.free(model, blocks)
            tokens_now -= n
            held_bytes -= len(blocks) * layout.block_bytes(model)
            token_bytes -= n * TOKEN_BYTES[model]
        advance(r.arrival_s)
        blocks = layout.allocate(r.model, r.num_tokens)
        if blocks is None:
            stats.refused[r.model] += 1
            stats.refused_by_phase[r.phase] += 1
            unusable = layout.free_bytes() - layout.usable_free_bytes(r.model)
            stats.external_at_refusal.append(max(0, unusable) / layout.pool_bytes)
            continue
        stats.served += 1
        tokens_now += r.num_tokens
        held_bytes += len(blocks) * layout.block_bytes(r.model)
        token_bytes += r.num_tokens * TOKEN_BYTES[r.model]
        heapq.heappush(held, (r.arrival_s + r.hold_s, seq, r.model, blocks, r.num_tokens))
        seq += 1
    advance(duration_s)
    return stats


def summarize(stats: Stats, pool_bytes: int, duration_s: float, num_requests: int) -> dict[str, object]:
    return {
        "tokens_cached_per_mib": stats.token_seconds / duration_s / (pool_bytes / MIB),
        "kv_bytes_used_fraction": stats.byte_seconds_held / duration_s / pool_bytes,
        "internal_fragmentation": 1 - stats.byte_seconds_tokens / stats.byte_seconds_held
        if stats.byte_seconds_held else 0.0,
        "external_fragmentation_at_refusal_mean": statistics.fmean(stats.external_at_refusal)
        if stats.external_at_refusal else 0.0,
        "refused": sum(stats.refused.values()),
        "refused_fraction": sum(stats.refused.values()) / num_requests,
        "refused_by_model": stats.refused,
        "refused_by_phase": stats.refused_by_phase,
        "served": stats.served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-gib", type=float, default=32.0)
    parser.add_argument("--rate", type=float, nargs="+", default=[16.0, 32.0, 48.0, 64.0, 96.0])
    parser.add_argument("--b-kv", nargs="+", choices=sorted(B_SCALES), default=["fp8", "int8-scales"])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--tpot-ms", type=float, default=25.0, help="decode step: how long a request holds its KV")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="docs/results/kv-slab-fragmentation.json")
    args = parser.parse_args()
    pool_bytes = int(args.pool_gib * (1 << 30))
    layouts = {"slab": SlabLayout, "static": StaticLayout, "uniform": UniformLayout}
    configs: list[dict[str, object]] = []
    for b_kv in args.b_kv:
        set_b_format(b_kv)
        print(f"model B KV {b_kv}:")
        configs.append(run_config(args, pool_bytes, layouts, b_kv))
    out = {
        "what": "two Llama-3.1-8B KV formats sharing one pool: slab vs static half/half vs one uniform block size",
        "pool_bytes": pool_bytes, "phase_share_of_A": PHASE_SHARE_A, "duration_s": args.duration_s,
        "tpot_s": args.tpot_ms / 1e3, "seeds": args.seeds,
        "workload": "sharegpt lengths (input <= 4096, output <= 1024), Poisson arrivals, mix shifts per third",
        "configs": configs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


def run_config(args: argparse.Namespace, pool_bytes: int, layouts: dict[str, type], b_kv: str) -> dict[str, object]:
    results: list[dict[str, object]] = []
    for rate in args.rate:
        per_layout: dict[str, list[dict[str, object]]] = {name: [] for name in layouts}
        for seed in args.seeds:
            requests = build_workload(seed, rate, args.duration_s, args.tpot_ms / 1e3)
            for name, make in layouts.items():
                stats = run(make(pool_bytes), requests, args.duration_s)
                per_layout[name].append(summarize(stats, pool_bytes, args.duration_s, len(requests)))
        row: dict[str, object] = {"rate_rps": rate}
        for name, runs in per_layout.items():
            mean = {k: statistics.fmean(float(r[k]) for r in runs)  # type: ignore[arg-type]
                    for k in ("tokens_cached_per_mib", "kv_bytes_used_fraction", "internal_fragmentation",
                              "external_fragmentation_at_refusal_mean", "refused", "refused_fraction")}
            row[name] = {"mean_over_seeds": mean, "runs": runs}
        slab = row["slab"]["mean_over_seeds"]  # type: ignore[index]
        for base in ("static", "uniform"):
            other = row[base]["mean_over_seeds"]  # type: ignore[index]
            row[f"slab_vs_{base}"] = {
                "tokens_cached_per_mib_ratio": slab["tokens_cached_per_mib"] / other["tokens_cached_per_mib"],
                "refused_ratio": (slab["refused"] / other["refused"]) if other["refused"] else math.nan,
            }
        results.append(row)
        print(f"  rate {rate:5.1f}: " + "  ".join(
            f"{name}: {row[name]['mean_over_seeds']['tokens_cached_per_mib']:.2f} tok/MiB "  # type: ignore[index]
            f"refused {row[name]['mean_over_seeds']['refused_fraction']:.3f} "  # type: ignore[index]
            f"int {row[name]['mean_over_seeds']['internal_fragmentation']:.3f} "  # type: ignore[index]
            f"ext {row[name]['mean_over_seeds']['external_fragmentation_at_refusal_mean']:.3f}"  # type: ignore[index]
            for name in layouts))
    pool = KVSlabPool(pool_bytes, {"A": A_BLOCK, "B": B_BLOCK})
    return {
        "model_b_kv": b_kv, "block_bytes": {"A": A_BLOCK, "B": B_BLOCK},
        "slab_bytes": pool.slab_bytes, "num_slabs": pool.num_slabs, "unused_tail_bytes": pool.unused_tail_bytes,
        "blocks_per_slab": {"A": pool.blocks_per_slab("A"), "B": pool.blocks_per_slab("B")},
        "uniform_tokens_per_block": {"A": BLOCK_TOKENS, "B": A_BLOCK // B_TOKEN_BYTES},
        "results": results,
    }


if __name__ == "__main__":
    main()
