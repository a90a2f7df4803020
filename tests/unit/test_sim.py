"""The simulator on the real policies, perf model and block allocator: determinism, a pinned run,
conservation of requests and KV blocks, each policy's unit split, bursts, preemption, prefix
reuse, admission, and the CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.bench.metrics import RequestRecord, SloSpec
from tandem.bench.workload import RequestSpec
from tandem.cli import main
from tandem.policy.policies import DynamicConfig, DynamicPolicy, Policy, StaticConfig, get_policy
from tandem.policy.types import ClusterSnapshot, Decision, Predictor
from tandem.sim.config import CellConfig, build_predictor, cell_config_for, kv_num_blocks, load_shape
from tandem.sim.run import simulate, workload_requests
from tandem.sim.simulator import REASON_NO_KV, Simulator

SLO = SloSpec(ttft_s=0.25, tbt_s=0.1, ttft_s_per_1k_input=0.25)
SHAPE = load_shape("Llama-3.1-8B")
PREDICTOR, A100 = build_predictor("A100-80G", SHAPE)
CELL = cell_config_for(A100, SHAPE)


# Dynamic without its rate check: the tests of its split (bursts, contention, decode's slack),
# which the rate check would mostly leave for chunked's aggregated steps on these workloads.
SPLIT = DynamicPolicy(DynamicConfig(rate_check=False))


class Recording:
    """A policy wrapper that keeps every (snapshot, decision) pair."""

    def __init__(self, name: str | Policy) -> None:
        self.policy = get_policy(name) if isinstance(name, str) else name
        self.calls: list[tuple[ClusterSnapshot, Decision]] = []

    def __call__(self, snapshot: ClusterSnapshot, predictor: Predictor) -> Decision:
        decision = self.policy(snapshot, predictor)
        self.calls.append((snapshot, decision))
        return decision


def run_sim(requests: Sequence[RequestSpec], policy: str | Policy, *, cell: CellConfig = CELL,
            admission: bool = True, num_cells: int = 1) -> tuple[Simulator, list[RequestRecord]]:
    sim = Simulator(policy=get_policy(policy) if isinstance(policy, str) else policy, predictor=PREDICTOR,
                    cell_config=cell, slo=SLO, num_cells=num_cells, admission=admission)
    result = sim.run(requests)
    return sim, result.records


def sharegpt(rate: float, n: int, seed: int = 0) -> list[RequestSpec]:
    return workload_requests("sharegpt", rate_rps=rate, num_requests=n, seed=seed)


def test_kv_blocks_come_from_memory_minus_weights() -> None:
    # 8B in bf16 is ~16 GB; 0.9 x 80 GB - 16 GB at 128 KiB of K/V per token -> ~427k tokens.
    assert 26_000 < CELL.num_blocks < 27_000
    assert CELL.total_units == 108 and CELL.num_layers == 32
    seventy = load_shape("Llama-3.1-70B")
    assert kv_num_blocks(seventy, 80e9) > 0  # TP 4: weights per rank fit
    with pytest.raises(ValueError):
        kv_num_blocks(seventy.with_tp(1), 80e9)


@pytest.mark.parametrize("policy", ["chunked", "static", "dynamic", "adaptive"])
def test_same_seed_same_run(policy: str) -> None:
    requests = sharegpt(8.0, 60, seed=3)
    _, first = run_sim(requests, policy)
    _, second = run_sim(requests, policy)
    assert first == second


def test_pinned_small_run() -> None:
    """Computed once from this simulator; a change here means the simulation drifted."""
    result = simulate(sharegpt(4.0, 30, seed=7), policy="dynamic", predictor=PREDICTOR, cell_config=CELL, slo=SLO)
    s = result.summary
    assert (s["num_ok"], s["num_failed"]) == (30, 0)
    assert round(s["duration_s"], 3) == pytest.approx(PINNED["duration_s"])
    assert round(s["ttft_s"]["p50"] * 1e3, 2) == pytest.approx(PINNED["ttft_p50_ms"])
    assert round(s["tbt_s"]["mean"] * 1e3, 2) == pytest.approx(PINNED["tbt_mean_ms"])
    assert round(s["slo_attainment"], 3) == pytest.approx(PINNED["slo_attainment"])


# Re-pinned when the perf model began counting causal attention pairs at the GPU presets'
# attention efficiency, and the presets brought MuxWise's worst-case contention (issue 13); again
# when dynamic began taking every pending prompt in one hybrid step when that step fits TBT.
PINNED = {"duration_s": 15.562, "ttft_p50_ms": 20.88, "tbt_mean_ms": 12.9, "slo_attainment": 1.0}


@pytest.mark.parametrize("policy", ["chunked", "static", "dynamic", "adaptive"])
def test_every_request_ends_and_every_block_returns(policy: str) -> None:
    # A pool of 600 blocks (9600 tokens) makes requests wait for blocks; one request cannot fit.
    requests = sharegpt(20.0, 120, seed=1)
    huge = RequestSpec("r999999", 1.0, 9000, 1000)
    cell = replace(CELL, num_blocks=600)
    sim, records = run_sim([*requests, huge], policy, cell=cell)
    assert len(records) == len(requests) + 1
    for r in records:
        if r.ok:
            spec = next(q for q in [*requests, huge] if q.request_id == r.request_id)
            assert len(r.token_times_s) == spec.output_len
            assert list(r.token_times_s) == sorted(r.token_times_s) and r.token_times_s[0] >= r.arrival_s
        else:
            assert r.error
    assert next(r for r in records if r.request_id == "r999999").error == REASON_NO_KV
    assert sum(c.stats.num_kv_waits for c in sim.cells) > 0
    for cell_state in sim.cells:
        assert cell_state.allocator.num_free_blocks == cell.num_blocks


def test_chunked_never_splits_units() -> None:
    rec = Recording("chunked")
    sim, records = run_sim(sharegpt(10.0, 80), rec)
    assert all(r.ok for r in records)
    total = CELL.total_units
    assert rec.calls
    for _, d in rec.calls:
        assert d.aggregated and d.prefill_units in (0, total) and d.decode_units in (0, total)
    assert sim.cells[0].stats.num_split_launches == 0


def test_static_keeps_its_split() -> None:
    rec = Recording("static")
    sim, _ = run_sim(sharegpt(10.0, 80), rec)
    prefill, decode = StaticConfig().split(CELL.total_units)
    assert {(d.prefill_units, d.decode_units, d.aggregated) for _, d in rec.calls} == {(prefill, decode, False)}
    stats = sim.cells[0].stats.to_dict()
    assert stats["mean_prefill_units"] == pytest.approx(prefill)
    assert stats["mean_decode_units"] == pytest.approx(decode)


def test_a_burst_moves_units_to_prefill_under_dynamic() -> None:
    # Four long decodes, then 40 prompts of 1500 tokens at once.
    decodes = [RequestSpec(f"d{i}", 0.0, 100, 400) for i in range(4)]
    burst = [RequestSpec(f"b{i:02d}", 1.0, 1500, 20) for i in range(40)]
    rec = Recording(SPLIT)
    run_sim([*decodes, *burst], rec, admission=False)
    total = CELL.total_units
    quiet = [d for s, d in rec.calls if 0.2 < s.now_s < 1.0]
    busy = [d for s, d in rec.calls if s.now_s >= 1.0 and s.queued and s.decode_context_lens]
    assert quiet and all(d.decode_units == total and d.prefill_units == 0 for d in quiet)
    assert busy and max(d.prefill_units for d in busy) >= total - 8
    assert min(d.decode_units for d in busy) < total // 4


def test_a_short_request_preempts_a_long_prefill_which_resumes() -> None:
    long = RequestSpec("r0", 0.0, 8000, 5)
    short = RequestSpec("r1", 0.05, 64, 5)
    rec = Recording("dynamic")
    sim, records = run_sim([long, short], rec, admission=False)
    assert sim.cells[0].stats.num_preemptions == 1
    assert any(d.preempt == "r0" for _, d in rec.calls)
    assert any(s.paused_prefill is not None and s.paused_prefill.layers_done > 0 for s, _ in rec.calls)
    by_id = {r.request_id: r for r in records}
    assert all(r.ok for r in records)
    assert by_id["r1"].ttft_s is not None and by_id["r1"].ttft_s <= SLO.ttft_limit_s(64)
    assert by_id["r1"].token_times_s[0] < by_id["r0"].token_times_s[0]


def test_multi_turn_sessions_reuse_their_prefix() -> None:
    requests = workload_requests("multiturn", rate_rps=2.0, num_requests=40, seed=0)
    assert any(r.shared_prefix_len > 0 for r in requests)
    sim, records = run_sim(requests, "dynamic")
    assert all(r.ok for r in records)
    alloc = sim.cells[0].allocator
    assert alloc.num_prefix_hit_tokens > 0.3 * sum(r.shared_prefix_len for r in requests)


def test_admission_refuses_under_overload_only_when_on() -> None:
    requests = workload_requests("azure-code", rate_rps=40.0, num_requests=150, seed=2)
    _, with_admission = run_sim(requests, "dynamic", admission=True)
    _, without = run_sim(requests, "dynamic", admission=False)
    refused = [r for r in with_admission if r.error and r.error.startswith("admission refused")]
    assert len(refused) > 10
    assert all(r.ok for r in without)


def test_several_cells_share_the_load() -> None:
    sim, records = run_sim(sharegpt(20.0, 100), "dynamic", num_cells=2)
    assert all(r.ok for r in records)
    assert all(c.stats.num_decisions > 0 for c in sim.cells)


def test_fixed_costs_slow_the_run() -> None:
    requests = sharegpt(5.0, 40)
    _, base = run_sim(requests, "chunked")
    _, slow = run_sim(requests, "chunked", cell=replace(CELL, handoff_s=0.01, step_overhead_s=0.002))
    assert sum(r.e2e_s or 0 for r in slow) > sum(r.e2e_s or 0 for r in base)


def test_cli_sweeps_policies_on_a_cpu_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "torch_dtype": "float32",
    }))
    out = tmp_path / "sim.json"
    code = main(["sim", "--hardware", "cpu", "--model-dir", str(model_dir), "--policy", "chunked", "--policy",
                 "dynamic", "--rate", "2", "--num-requests", "20", "--max-input-len", "256", "--max-output-len",
                 "32", "--ttft-slo-ms", "2000", "--tbt-slo-ms", "200", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["runs"]] == ["chunked", "dynamic"]
    assert "dynamic" in result["goodput_ratio_vs_chunked"]
    assert "goodput relative to chunked" in capsys.readouterr().out


def test_cli_takes_policies_with_config_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    args = ["sim", "--hardware", "H100-SXM", "--workload", "azure-code", "--rate", "8", "--num-requests", "40"]
    code = main([*args, "--policy", "chunked", "chunked[order=edf]", "dynamic[rate_check=false, kv_reserve=0.3]",
                 "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["runs"]] == ["chunked", "chunked[order=edf]",
                                                     "dynamic[rate_check=false, kv_reserve=0.3]"]
    capsys.readouterr()
    # A field the policy's config lacks fails before anything runs, naming the fields it has.
    assert main([*args, "--policy", "chunked", "dynamic[rate_chek=true]", "--out", str(out)]) == 2
    assert "rate_check" in capsys.readouterr().err


def test_a_profile_brings_its_device_and_contention(tmp_path: Path) -> None:
    from tandem.perf.calibration import CalibrationSample, ContentionGuard
    from tandem.perf.hardware import CPU_PLACEHOLDER
    from tandem.perf.model import PerfModel
    from tandem.perf.profile import PerfProfile, save_profile

    hardware = replace(CPU_PLACEHOLDER, num_units=4, bandwidth_knee_units=2)
    guard = ContentionGuard([1, 4], {"decode": [[1.5, 1.5], [1.5, 1.5]]})
    samples = (CalibrationSample("prefill", 128, 4, 0.2, 0.1), CalibrationSample("decode", 8, 4, 0.02, 0.01))
    path = tmp_path / "profile.json"
    save_profile(PerfProfile(hardware=hardware, calibration_samples=samples, contention=guard), path)
    shape = load_shape("Llama-3.1-8B").with_tp(1)
    predictor, spec = build_predictor("cpu", shape, profile_path=path)
    assert spec.num_units == 4
    assert predictor.contention(2, 2) == pytest.approx(1.5)
    flat, _ = build_predictor("cpu", shape, profile_path=path, contention=1.1)
    assert flat.contention(2, 2) == pytest.approx(1.1)
    # The profile's calibration doubles both phases' predictions.
    base = PerfModel(hardware, shape)
    assert predictor.predict_decode([100], 4) == pytest.approx(2 * base.predict_decode([100], 4))


def test_a_tighter_policy_tbt_target_gives_decode_more_units() -> None:
    requests = workload_requests("azure-conv", rate_rps=5.0, num_requests=80, seed=0)
    shares = []
    for target in (None, 0.05):
        # split decisions only: the target sizes decode's share of a split
        policy = DynamicPolicy(DynamicConfig(whole_hybrid=False, kv_aware=False))
        sim = Simulator(policy=policy, predictor=PREDICTOR, cell_config=CELL, slo=SLO,
                        admission=False, policy_tbt_s=target)
        sim.run(requests)
        assert sim.policy_slo.tbt_s == (target or SLO.tbt_s)
        shares.append(sim.cells[0].stats.to_dict()["mean_decode_units"])
    assert shares[1] > shares[0]


def test_split_launches_pay_contention_and_reconfiguration_aggregated_steps_do_not() -> None:
    # The A100 preset's guard (MuxWise: decode up to 20 % slower beside prefill) is the clock's
    # too: dynamic's decode steps beside prefill take longer than the same steps alone would.
    assert PREDICTOR.contention(30, 78) == pytest.approx(1.2)
    assert PREDICTOR.contention(78, 30, "prefill") == pytest.approx(1.08)
    requests = sharegpt(10.0, 80)
    # Re-masking SMs (Bullet Table 5: 4.1 us) is paid by split launches whose units change,
    # never by chunked's aggregated steps.
    slow = replace(CELL, reconfig_s=0.01)
    for policy, changes in (("chunked", False), (SPLIT, True)):
        base = simulate(requests, policy=policy, predictor=PREDICTOR, cell_config=CELL, slo=SLO)
        paid = simulate(requests, policy=policy, predictor=PREDICTOR, cell_config=slow, slo=SLO)
        if changes:
            assert paid.summary["tbt_s"]["mean"] > base.summary["tbt_s"]["mean"]
        else:
            assert paid.records == base.records
    with pytest.raises(ValueError):
        replace(CELL, reconfig_s=-1.0)


@pytest.mark.parametrize("units", [1, 3, 16, 64])
def test_units_changes_the_unit_count_and_nothing_else(tmp_path: Path, units: int) -> None:
    from tandem.perf.hardware import CPU_PLACEHOLDER
    from tandem.perf.profile import PerfProfile, save_profile

    hardware = replace(CPU_PLACEHOLDER, num_units=2, bandwidth_knee_units=1.5)
    path = tmp_path / "profile.json"
    save_profile(PerfProfile(hardware=hardware), path)
    shape = load_shape("Llama-3.1-8B").with_tp(1)
    base, _ = build_predictor("cpu", shape, profile_path=path)
    predictor, spec = build_predictor("cpu", shape, profile_path=path, units=units)
    assert spec.num_units == units
    assert spec.peak_flops_per_unit == hardware.peak_flops_per_unit
    # Each unit draws the bandwidth it drew before: the whole device's beyond the knee.
    per_unit = hardware.mem_bandwidth / hardware.bandwidth_knee_units
    assert spec.mem_bandwidth == pytest.approx(per_unit * min(units, 1.5))
    # On the units both devices have, predictions agree; prefill on all units scales with them.
    common = min(units, 2)
    assert predictor.predict_prefill([(512, 0)], common) == pytest.approx(base.predict_prefill([(512, 0)], common))
    if units > 2:
        assert predictor.predict_prefill([(512, 0)], units) < base.predict_prefill([(512, 0)], 2)
    _, gpu = build_predictor("A100-80G", shape, units=54)
    assert gpu.num_units == gpu.num_sms == 54
    with pytest.raises(ValueError, match="units must be positive"):
        build_predictor("cpu", shape, profile_path=path, units=0)


@pytest.mark.parametrize("units", [1, 2, 3, 8, 16])
def test_grow_memory_scales_bandwidth_and_knee_with_the_units(tmp_path: Path, units: int) -> None:
    from tandem.perf.hardware import CPU_PLACEHOLDER
    from tandem.perf.profile import PerfProfile, save_profile

    hardware = replace(CPU_PLACEHOLDER, num_units=2, bandwidth_knee_units=1.5)
    path = tmp_path / "profile.json"
    save_profile(PerfProfile(hardware=hardware), path)
    shape = load_shape("Llama-3.1-8B").with_tp(1)
    same, _ = build_predictor("cpu", shape, profile_path=path, units=units)
    predictor, spec = build_predictor("cpu", shape, profile_path=path, units=units, grow_memory=True)
    assert spec.num_units == units and spec.peak_flops_per_unit == hardware.peak_flops_per_unit
    assert spec.mem_bandwidth == pytest.approx(hardware.mem_bandwidth * units / 2)
    assert spec.bandwidth_knee_units == pytest.approx(min(units, 1.5 * units / 2))
    # A decode step reads the weights: on the whole device, more memory makes it faster from 2
    # cores on, the same at 2 and slower below.
    grown, kept = predictor.predict_decode([512] * 8, units), same.predict_decode([512] * 8, units)
    if units > 2:
        assert grown < kept
    elif units == 2:
        assert grown == pytest.approx(kept)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_snapshots_show_the_pool_and_dynamic_aggregates_when_kv_is_short(seed: int) -> None:
    """A pool that holds a few requests at a time: each snapshot carries its free blocks and the
    requests waiting for blocks, and dynamic never splits while one waits."""
    cell = replace(CELL, num_blocks=600)
    recording = Recording("dynamic")
    sim, records = run_sim(sharegpt(20, 80, seed), recording, cell=cell, admission=False)
    assert all(r.error is None for r in records)
    snaps = [s for s, _ in recording.calls]
    assert all(s.kv_total_blocks == 600 and s.kv_free_blocks is not None and 0 <= s.kv_free_blocks <= 600
               for s in snaps)
    waited = [(s, d) for s, d in recording.calls if s.kv_waiting and s.decode_context_lens and s.has_prefill_work]
    assert waited, "the small pool should make requests wait for blocks"
    assert all(d.aggregated for _, d in waited)
    assert sim.cells[0].stats.num_kv_waits > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_slack_counts_requests_waiting_for_their_first_decode_step(seed: int) -> None:
    """A request handed to decode has waited since its first token: no snapshot may give decode
    more slack than the oldest such gap leaves (else a burst pauses decode past the SLO for it)."""
    recording = Recording(SPLIT)
    _, records = run_sim(workload_requests("azure-code", rate_rps=6, num_requests=150, seed=seed), recording,
                         admission=False)
    gaps = sorted((r.token_times_s[0], r.token_times_s[1]) for r in records if len(r.token_times_s) > 1)
    checked = 0
    for snapshot, _ in recording.calls:
        now = snapshot.now_s
        open_since = [first for first, second in gaps if first < now < second]
        if not open_since:
            continue
        checked += 1
        assert snapshot.slack_s <= max(0.0, SLO.tbt_s - (now - min(open_since))) + 1e-9
    assert checked > 50


def test_a_burst_waits_for_decodes_step_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst needs decode's units: its layers launch only once decode's step in flight ended
    (on what decode leaves, layers sized for every unit would stall decode past its slack)."""
    from tandem.sim import simulator as sim_module

    launches: list[tuple[bool, int]] = []  # (decode busy, units) of every burst launch
    original = sim_module._Cell._launch_layers

    def launch(cell: sim_module._Cell, now: float, job: object, units: int, layers: int) -> None:
        if cell.current is not None and cell.current.burst:
            launches.append((cell.decode_busy, units))
        original(cell, now, job, units, layers)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_module._Cell, "_launch_layers", launch)
    sim, records = run_sim(workload_requests("azure-code", rate_rps=6, num_requests=150, seed=1), SPLIT,
                           admission=False)
    assert all(r.error is None for r in records)
    assert launches and sim.cells[0].stats.num_bursts == len(launches)
    assert all(not busy and units == CELL.total_units for busy, units in launches)


def _drop_run(requests: Sequence[RequestSpec], policy: str, drop_late: bool, slo: SloSpec = SLO,
              cell: CellConfig = CELL) -> tuple[Simulator, list[RequestRecord], list[tuple[str, bool, int]]]:
    """A run with admission off; also every request the simulator rejects, as (id, started,
    prompt tokens computed) when it is rejected."""
    sim = Simulator(policy=get_policy(policy), predictor=PREDICTOR, cell_config=cell, slo=slo,
                    admission=False, drop_late=drop_late)
    rejected: list[tuple[str, bool, int]] = []
    reject = sim.reject

    def spy(req):  # type: ignore[no-untyped-def]
        rejected.append((req.request_id, req.started, req.prefilled))
        reject(req)

    sim.reject = spy  # type: ignore[method-assign]
    records = sim.run(requests).records
    return sim, records, rejected


def test_early_drop_drops_a_prompt_that_cannot_make_it_alone_and_serves_the_rest() -> None:
    """Crafted: a long prompt whose prefill alone takes twice its whole TTFT SLO (no per-1k term)
    arrives with short ones; with early drop it fails at once with the services' message and the
    short ones are served; without, everything is computed."""
    alone_s = PREDICTOR.predict_prefill([(8000, 0)], CELL.total_units)
    slo = SloSpec(ttft_s=alone_s / 2, tbt_s=1.0)
    requests = [RequestSpec("r0", 0.0, 8000, 4), *(RequestSpec(f"r{i}", 0.001 * i, 16, 4) for i in range(1, 6))]
    for policy in ("chunked", "dynamic"):
        sim, records, rejected = _drop_run(requests, policy, True, slo)
        by_id = {r.request_id: r for r in records}
        error = by_id["r0"].error
        assert not by_id["r0"].ok and error is not None and error.startswith("dropped before prefill")
        assert by_id["r0"].token_times_s == ()
        assert rejected == [("r0", False, 0)]
        assert all(by_id[f"r{i}"].ok for i in range(1, 6))
        assert sum(c.stats.num_dropped for c in sim.cells) == 1
        _, kept, _ = _drop_run(requests, policy, False, slo)
        assert all(r.ok for r in kept)


@pytest.mark.parametrize("policy", ["chunked", "dynamic"])
@pytest.mark.parametrize("seed", [4, 5])
def test_early_drop_only_when_asked_only_unstarted_prompts_late_past_the_margin(policy: str, seed: int) -> None:
    """Bursty overload (gamma arrivals, CV 4, admission off): with early drop some prompts fail
    before any of their prefill ran, each told it would be late by more than DROP_MARGIN of the
    TTFT SLO even alone; every other request gets all its tokens, and every block comes back
    (the simulator checks that at the end). Without it, nothing is dropped."""
    from tandem.policy.local import DROP_MARGIN

    requests = workload_requests("azure-code", rate_rps=16.0, num_requests=150, seed=seed, arrival="gamma", cv=4.0)
    specs = {r.request_id: r for r in requests}
    sim, records, rejected = _drop_run(requests, policy, False)
    assert all(r.ok for r in records) and not rejected
    assert sum(c.stats.num_dropped for c in sim.cells) == 0

    sim, records, rejected = _drop_run(requests, policy, True)
    dropped = [r for r in records if not r.ok]
    assert dropped and sum(c.stats.num_dropped for c in sim.cells) == len(dropped) == len(rejected)
    assert all(not started and computed == 0 for _, started, computed in rejected)
    for r in dropped:
        assert r.error is not None and r.error.startswith("dropped before prefill") and r.token_times_s == ()
        late_s = float(r.error.split(" by ")[1].split(" s even")[0])
        assert late_s > DROP_MARGIN * SLO.ttft_s - 0.005  # the message rounds to 10 ms
    for r in records:
        if r.ok:
            assert len(r.token_times_s) == specs[r.request_id].output_len
