"""The CUDA cell on a real GPU: partitions, repartition cost, handoff latency, CUDA graphs and the
calibrated perf model, for a Llama-3.1-8B shape on random weights. Writes one JSON file.

Needs a CUDA device (run it where one is lent: DEVELOPERS.md). Parts:
- partitions: every split's two sides, their SM counts as the SMs report them (``%smid``) and
  whether they overlap; the time to create all green contexts;
- repartition: host cost of ``PhaseStream.switch`` and its device-side cost (a chain of small
  kernels on one stream vs the same chain switching partition before every kernel);
- handoff: prefill's K/V written into the pool, the request's block ids sent to another process
  (a pipe; in the cell it is a gRPC message), which maps the same pool by CUDA IPC handle and
  reads those blocks: the time from prefill's last write done to decode having the K/V;
- graphs: one decode step of the 8B shape, eager (op by op, torch attention) vs replayed from a
  CUDA graph, at batch 1 / 8 / 32, context 1024;
- graph_attention: graph decode steps with torch's gathered attention vs flashinfer's paged decode
  (``decode_svc --cuda-attention``), batch 1-64, context 512-8192, look-ahead 1 and 4;
- profile: ``tandem.cuda.profiler`` (held-out error of the calibrated model, contention), and the
  uncalibrated H100 preset's predictions (what ``tandem sim`` uses) against the measurements.

Usage: python bench/cuda_cell.py [--out docs/results/cuda-cell-h100.json] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.cuda.partition import PhaseStream, SmPartitions  # noqa: E402
from tandem.cuda.smid import launch_smid  # noqa: E402


def _log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def bench_partitions() -> dict[str, Any]:
    t0 = time.perf_counter()
    parts = SmPartitions()
    created_s = time.perf_counter() - t0
    rows = []
    for k in parts.prefill_counts:
        if not 0 < k < parts.total_sms:
            continue
        p = parts.partitions[k]
        with torch.cuda.stream(p.stream("prefill")):
            a = launch_smid(2048, 50000)
        with torch.cuda.stream(p.stream("decode")):
            b = launch_smid(2048, 50000)
        torch.cuda.synchronize()
        sa, sb = set(a.tolist()), set(b.tolist())
        rows.append({"prefill_sms": k, "decode_sms": p.decode_sms, "prefill_sms_seen": len(sa),
                     "decode_sms_seen": len(sb), "overlap": len(sa & sb)})
    _log(f"partitions: {len(rows)} splits in {created_s:.2f} s; overlaps {sum(r['overlap'] for r in rows)}")
    return {"parts": parts, "json": {"total_sms": parts.total_sms, "granularity": parts.granularity,
                                      "create_all_s": created_s, "splits": rows}}


def bench_repartition(parts: SmPartitions, n: int = 2000) -> dict[str, Any]:
    a, b = parts.for_phase("prefill", 32), parts.for_phase("prefill", 96)
    x = torch.zeros(1024, device="cuda")
    phase = PhaseStream("prefill", a)
    # host cost of a switch alone
    t0 = time.perf_counter()
    for i in range(n):
        phase.switch(b if i % 2 == 0 else a)
    host_switch_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()

    def chain(switching: bool) -> float:
        phase = PhaseStream("prefill", a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(phase.stream)
        for i in range(n):
            stream = phase.switch(b if i % 2 == 0 else a) if switching else phase.stream
            with torch.cuda.stream(stream):
                x.add_(1.0)
        end.record(phase.stream)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / n

    same = [chain(False) for _ in range(5)]
    switched = [chain(True) for _ in range(5)]
    cost_us = (statistics.median(switched) - statistics.median(same)) * 1e6
    _log(f"repartition: host {host_switch_us:.2f} us per switch; kernel chain {statistics.median(same) * 1e6:.2f} "
         f"-> {statistics.median(switched) * 1e6:.2f} us per kernel, +{cost_us:.2f} us per switch")
    return {"host_switch_us": host_switch_us, "chain_same_stream_us": [s * 1e6 for s in same],
            "chain_switching_us": [s * 1e6 for s in switched], "device_cost_per_switch_us": cost_us}


def _handoff_child(conn: Any, pool_bytes: bytes) -> None:
    from tandem.cuda.ipc import open_tensors

    pool = open_tensors(pool_bytes)["kv"]  # [layers, 2, blocks, bs, kvh, d]
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        sent_at, blocks = msg
        received = time.perf_counter() - sent_at
        idx = torch.tensor(blocks, device="cuda")
        kv = pool.index_select(2, idx)  # decode gathers the request's blocks: all layers, K and V
        total = float(kv.sum(dtype=torch.float32))
        conn.send((received, time.perf_counter() - sent_at, total))


def bench_handoff(trials: int = 200) -> dict[str, Any]:
    from tandem.cuda.ipc import export_tensors

    layers, blocks, bs, kvh, d = 32, 512, 16, 8, 128
    pool = torch.zeros(layers, 2, blocks, bs, kvh, d, dtype=torch.bfloat16, device="cuda")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_handoff_child, args=(child, export_tensors({"kv": pool})), daemon=True)
    proc.start()
    assert parent.recv() == "ready"
    lat, transit, ok = [], [], 0
    gen = torch.Generator().manual_seed(0)
    for i in range(trials):
        req_blocks = torch.randperm(blocks, generator=gen)[:64].tolist()  # a 1024-token prompt
        value = float(i % 7 + 1)
        pool[:, :, req_blocks] = value  # prefill's K/V writes
        torch.cuda.synchronize()  # prefill's last layer done
        parent.send((time.perf_counter(), req_blocks))
        got, dt, total = parent.recv()
        lat.append(dt)
        transit.append(got)
        ok += total == value * layers * 2 * 64 * bs * kvh * d
    parent.send(None)
    proc.join(timeout=30)
    lat_ms = sorted(x * 1e3 for x in lat[10:])
    transit_ms = sorted(x * 1e3 for x in transit[10:])
    out = {"trials": len(lat_ms), "kv_read_correct": ok, "mean_ms": statistics.fmean(lat_ms),
           "p50_ms": lat_ms[len(lat_ms) // 2], "p99_ms": lat_ms[int(0.99 * (len(lat_ms) - 1))],
           "metadata_transit_mean_ms": statistics.fmean(transit_ms), "metadata_transit_p50_ms": transit_ms[len(transit_ms) // 2],
           "what": "prefill's K/V written and synchronised -> block ids over a pipe -> decode process maps the "
                   "pool by IPC handle (once, at start) and gathers the request's 64 blocks (1024 tokens, all layers)"}
    _log(f"handoff: metadata {out['metadata_transit_mean_ms']:.3f} ms; to K/V read: mean {out['mean_ms']:.3f} ms, p50 {out['p50_ms']:.3f}, p99 {out['p99_ms']:.3f}; correct {ok}/{trials}")
    return out


def bench_graphs(quick: bool) -> dict[str, Any]:
    from tandem.cuda.graphs import GraphDecoder
    from tandem.cuda.profiler import time_on
    from tandem.engine.attention import make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec
    from tandem.engine.model import LlamaModel
    from tandem.engine.random_weights import config_for_shape, random_weights
    from tandem.engine.runner import ModelRunner, SeqInput
    from tandem.perf.model_shape import model_preset

    config = config_for_shape(model_preset("Llama-3.1-8B"))
    model = LlamaModel(config, random_weights(config, torch.bfloat16, "cuda"), make_backend("torch", config.num_heads))
    batches, ctx, bs = (1, 8, 32), 1024, 16
    per_seq = ctx // bs + 1
    num_blocks = max(batches) * per_seq + 1
    pool = KVPool.create(KVPoolSpec.for_model(config, num_blocks, bs, torch.bfloat16), "cuda")
    runner = ModelRunner(model, pool)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(batches))]
    stream = torch.cuda.Stream()
    rows = []
    with torch.inference_mode():
        decoders = {k: GraphDecoder(model, pool, scratch_block=num_blocks - 1, lookahead=k, batch_buckets=batches,
                                    block_buckets=(per_seq,), stream=stream) for k in (1, 4)}
        for b in batches:
            eager = time_on(stream, lambda b=b: runner.forward([SeqInput([1], ctx - 1, tables[i]) for i in range(b)]), 10)
            graph = time_on(stream, lambda b=b: decoders[1].decode([1] * b, [ctx] * b, tables[:b]), 10)
            look4 = time_on(stream, lambda b=b: decoders[4].decode([1] * b, [ctx] * b, tables[:b]), 10) / 4
            # wall clock of eager includes the host's launch work: measure it too
            t0 = time.perf_counter()
            for _ in range(5):
                runner.forward([SeqInput([1], ctx - 1, tables[i]) for i in range(b)])
            torch.cuda.synchronize()
            eager_wall = (time.perf_counter() - t0) / 5
            t0 = time.perf_counter()
            for _ in range(5):
                decoders[1].decode([1] * b, [ctx] * b, tables[:b])
            torch.cuda.synchronize()
            graph_wall = (time.perf_counter() - t0) / 5
            rows.append({"batch": b, "context": ctx, "eager_ms": eager * 1e3, "graph_ms": graph * 1e3,
                         "graph_lookahead4_ms_per_step": look4 * 1e3, "eager_wall_ms": eager_wall * 1e3,
                         "graph_wall_ms": graph_wall * 1e3})
            _log(f"graphs: batch {b}: eager {eager * 1e3:.2f} ms (wall {eager_wall * 1e3:.2f}), graph {graph * 1e3:.2f} "
                 f"(wall {graph_wall * 1e3:.2f}), look-ahead 4 {look4 * 1e3:.2f} ms/step")
    del decoders, runner, pool, model
    torch.cuda.empty_cache()
    return {"rows": rows}


def bench_graph_attention(quick: bool) -> dict[str, Any]:
    """Graph decode steps of the 8B shape with each attention decode_svc can capture: torch's
    (each row's blocks gathered and padded to a context bucket, here exactly the context) and
    flashinfer's paged decode (the pool read in place), by batch and context; look-ahead 4 too.
    GPU time per step by CUDA events, and the host's time to launch one (plan included)."""
    from tandem.cuda.graphs import GraphDecoder
    from tandem.cuda.profiler import time_on
    from tandem.engine.attention import make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec
    from tandem.engine.model import LlamaModel
    from tandem.engine.random_weights import config_for_shape, random_weights
    from tandem.perf.model_shape import model_preset

    config = config_for_shape(model_preset("Llama-3.1-8B"))
    model = LlamaModel(config, random_weights(config, torch.bfloat16, "cuda"), make_backend("torch", config.num_heads))
    bs = 16
    grid = [(b, ctx, 1) for ctx in (512, 2048) for b in (1, 8, 32, 64)] + [(b, 8192, 1) for b in (1, 8)]
    grid += [(b, 2048, 4) for b in (1, 8, 32)]
    if quick:
        grid = [g for g in grid if g[0] <= 8 and g[1] <= 2048]
    per = {ctx: -(-(ctx + 4) // bs) for _, ctx, _ in grid}  # blocks a row needs, look-ahead included
    num_blocks = max(b * per[ctx] for b, ctx, _ in grid) + 1
    pool = KVPool.create(KVPoolSpec.for_model(config, num_blocks, bs, torch.bfloat16), "cuda")
    pool.tensor.normal_()
    scratch, stream, mempool = num_blocks - 1, torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    batches = tuple(sorted({b for b, _, _ in grid}))
    decoders = {(name, k): GraphDecoder(model, pool, scratch_block=scratch, lookahead=k, batch_buckets=batches,
                                        block_buckets=tuple(sorted(set(per.values()))), stream=stream,
                                        mempool=mempool, capture_all=False, attention=name)
                for name in ("torch", "flashinfer") for k in (1, 4)}
    rows = []
    with torch.inference_mode():
        for b, ctx, k in grid:
            tables = [list(range(i * per[ctx], (i + 1) * per[ctx])) for i in range(b)]
            tokens, lens = [(31 * i + 7) % config.vocab_size for i in range(b)], [ctx] * b
            row: dict[str, Any] = {"batch": b, "context": ctx, "lookahead": k}
            outs = {}
            for name in ("torch", "flashinfer"):
                dec = decoders[name, k]
                gpu_s = time_on(stream, functools.partial(dec.decode, tokens, lens, tables), 20) / k
                host = []
                for j in range(10):  # contexts alternate by a token, so that each launch plans anew
                    t0 = time.perf_counter()
                    dec.decode(tokens, [ctx - j % 2] * b, tables)
                    host.append(time.perf_counter() - t0)
                    stream.synchronize()
                outs[name] = dec.decode(tokens, lens, tables)
                stream.synchronize()
                row[f"{name}_ms_per_step"] = gpu_s * 1e3
                row[f"{name}_host_launch_ms"] = statistics.median(host) * 1e3
            row["flashinfer_speedup"] = row["torch_ms_per_step"] / row["flashinfer_ms_per_step"]
            row["tokens_equal_fraction"] = float((outs["torch"][0] == outs["flashinfer"][0]).float().mean())
            row["max_logit_abs_diff"] = float((outs["torch"][1] - outs["flashinfer"][1]).abs().max())
            rows.append(row)
            _log(f"graph attention: batch {b} context {ctx} look-ahead {k}: torch {row['torch_ms_per_step']:.2f} ms/step, "
                 f"flashinfer {row['flashinfer_ms_per_step']:.2f} ({row['flashinfer_speedup']:.2f}x); host "
                 f"{row['torch_host_launch_ms']:.2f} / {row['flashinfer_host_launch_ms']:.2f} ms; tokens equal "
                 f"{row['tokens_equal_fraction']:.2f}")
    captures = {f"{name}-lookahead{k}": {"graphs": d.num_graphs, "capture_s": d.capture_s}
                for (name, k), d in decoders.items()}
    del decoders, pool, model
    torch.cuda.empty_cache()
    return {"rows": rows, "captures": captures, "block_size": bs}


def bench_profile(quick: bool, profile_out: Path | None) -> dict[str, Any]:
    from tandem.cuda.profiler import QUICK_CUDA_GRID, CudaGrid, profile_cuda
    from tandem.perf.hardware import hardware_preset
    from tandem.perf.model import PerfModel
    from tandem.perf.model_shape import model_preset
    from tandem.perf.profile import profile_to_dict, save_profile

    profile, raw = profile_cuda("Llama-3.1-8B", QUICK_CUDA_GRID if quick else CudaGrid(), progress=_log)
    if profile_out is not None:
        save_profile(profile, profile_out)
    preset = PerfModel(hardware_preset("H100-SXM"), model_preset("Llama-3.1-8B"))
    ctx = 1024
    vs_preset = []
    for run in raw["runs"]:  # type: ignore[union-attr]
        if run["phase"] == "prefill":
            pred = preset.predict_prefill([(run["size"], 0)], run["sms"])
        else:
            pred = preset.predict_decode([ctx] * run["size"], run["sms"])
        vs_preset.append({**run, "h100_preset_s": pred, "preset_over_measured": pred / run["measured_s"]})
    return {"profile": profile_to_dict(profile), "runs_vs_h100_preset": vs_preset,
            "contention": raw["contention"], "device_flops": raw["flops"], "copy_bandwidth_rw": raw["copy_bandwidth_rw"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/cuda-cell-h100.json")
    ap.add_argument("--profile-out", default=None, help="also write the profile file here")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: repartition,handoff,graphs,graph_attention,"
                                               "profile")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device is visible; this benchmark runs on a GPU machine", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.out)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))

    parts_info = bench_partitions()
    result["partitions"] = parts_info["json"]
    if "repartition" not in skip:
        result["repartition"] = bench_repartition(parts_info["parts"])
    parts_info["parts"].close()
    save()
    for name, fn in (("handoff", bench_handoff), ("graphs", lambda: bench_graphs(args.quick)),
                     ("graph_attention", lambda: bench_graph_attention(args.quick)),
                     ("profile", lambda: bench_profile(args.quick, Path(args.profile_out) if args.profile_out else None))):
        if name in skip:
            continue
        try:
            result[name] = fn()
        except Exception as exc:  # keep what the other parts measured
            result[name] = {"error": repr(exc)}
            _log(f"{name} failed: {exc!r}")
        save()
    _log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
