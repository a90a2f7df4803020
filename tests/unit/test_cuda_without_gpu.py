"""The CUDA backend on a machine without a GPU: everything imports, every entry point says what
is missing, and what can be checked on a CPU is (the decode step a CUDA graph captures, random
weights of any shape, the IPC description's parsing)."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys

import pytest
import torch

from tandem.engine.attention import make_backend
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.model import LlamaModel
from tandem.engine.random_weights import config_for_shape, random_weights, tiny_config
from tandem.engine.runner import ModelRunner, SeqInput
from tests.tiny_models import prefill_then_greedy, tiny_random_runner

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def test_the_cuda_package_imports_without_cuda() -> None:
    code = "import tandem.cuda.partition, tandem.cuda.ipc, tandem.cuda.graphs, tandem.cuda.smid, tandem.cuda.profiler"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, check=False)
    assert proc.returncode == 0, proc.stderr


@needs_no_gpu
def test_entry_points_say_a_gpu_is_needed() -> None:
    from tandem.cuda.partition import SmPartitions

    with pytest.raises(RuntimeError, match="CUDA device"):
        SmPartitions()
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "profile", "--device", "cuda", "--quick"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr


def test_sm_granularity_and_split_counts() -> None:
    from tandem.cuda.partition import sm_granularity, split_counts

    assert sm_granularity(9) == 8 and sm_granularity(8) == 2
    assert split_counts(132, 8) == list(range(8, 125, 8))
    assert split_counts(132, 8, 16) == list(range(16, 125, 16))
    with pytest.raises(ValueError, match="multiple"):
        split_counts(132, 8, 12)


def test_a_phase_gets_the_nearest_split_that_gives_it_sms() -> None:
    """The live failure this guards: decode asked for 13 of 132 SMs with splits of 32..96 (decode 100..36), and
    the nearest prefill count (132 - 13 = 119 -> 132, the whole device to prefill) gave decode none."""
    from tandem.cuda.partition import nearest_split

    total = 132
    splits = {0: (0, total), total: (total, 0), **{k: (k, total - k) for k in range(32, 101, 8)}}
    rng = random.Random(5)
    for _ in range(300):
        phase, sms = rng.choice(["prefill", "decode"]), rng.randrange(1, total + 1)
        key = nearest_split(splits, phase, sms)
        side = 0 if phase == "prefill" else 1
        got = splits[key][side]
        assert got > 0
        assert all(abs(got - sms) <= abs(pair[side] - sms) for pair in splits.values() if pair[side] > 0)
    assert splits[nearest_split(splits, "decode", 13)] == (96, 36)
    assert splits[nearest_split(splits, "decode", total)] == (0, total)
    assert splits[nearest_split(splits, "prefill", 131)] == (total, 0)
    with pytest.raises(ValueError, match="no split"):
        nearest_split({0: (0, total)}, "prefill", 8)


def test_ipc_descriptions_are_checked_before_any_cuda_call() -> None:
    from tandem.cuda.ipc import export_tensors, open_tensors

    for bad in (b"\xff\x00", b"[1, 2]", json.dumps({"format": "x", "tensors": {}}).encode()):
        with pytest.raises(ValueError, match="not a"):
            open_tensors(bad)
    with pytest.raises(ValueError, match="only CUDA tensors"):
        export_tensors({"w": torch.zeros(3)})


@pytest.mark.parametrize("preset", ["Llama-3.1-8B", "Qwen3-8B"])
def test_random_weights_have_the_shapes_the_model_expects(preset: str) -> None:
    from tandem.perf.model_shape import model_preset

    shape = model_preset(preset)
    config = config_for_shape(shape)
    # Two layers of the shape (a full 8B model would take 32 GB of RAM): every tensor's shape is
    # what the model indexes, and a forward pass runs.
    small = copy.copy(config)
    object.__setattr__(small, "num_layers", 1)
    object.__setattr__(small, "vocab_size", 1024)
    weights = random_weights(small, torch.bfloat16, seed=1)
    assert weights["0.qkv_proj"].shape == (shape.num_heads * shape.head_dim + 2 * shape.num_kv_heads * shape.head_dim,
                                           shape.hidden_size)
    assert weights["0.gate_up_proj"].shape == (2 * shape.intermediate_size, shape.hidden_size)
    runner = ModelRunner(LlamaModel(small, weights, make_backend("torch", small.num_heads)),
                         KVPool.create(KVPoolSpec.for_model(small, 4, 16, torch.bfloat16)))
    assert torch.isfinite(runner.forward([SeqInput(list(range(20)), 0, [0, 1])])).all()


def _step_decoder(runner, lookahead: int, attention):  # type: ignore[no-untyped-def]
    """A GraphDecoder over ``runner``'s model and pool, with ``attention``, for running its
    captured step eagerly on CPU: the capture itself needs CUDA; the step does not."""
    from tandem.cuda.graphs import GraphDecoder

    decoder = GraphDecoder.__new__(GraphDecoder)
    decoder.pool, decoder.lookahead, decoder.scratch_block = runner.pool, lookahead, 95
    decoder._model = copy.copy(runner.model)
    decoder._model.attention = attention
    return decoder


@pytest.mark.parametrize("lookahead", [1, 3])
def test_the_step_a_graph_captures_equals_eager_decode(lookahead: int) -> None:
    """GraphDecoder's device-side step (slots, masks and rope from positions; greedy feedback for
    look-ahead), run eagerly on CPU, gives eager decode's tokens. Capture needs CUDA (tests/gpu)."""
    from tandem.cuda.graphs import StaticDecodeAttention, _Graph

    rng = random.Random(lookahead)
    config = tiny_config()
    eager, graphed = tiny_random_runner(seed=3), tiny_random_runner(seed=3)
    decoder = _step_decoder(graphed, lookahead, StaticDecodeAttention())
    for _ in range(3):
        n, rows, blocks = rng.randrange(1, 7), 8, 8
        prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randrange(3, 100))] for _ in range(n)]
        perm = rng.sample(range(88), n * blocks)
        tables = [perm[i * blocks:(i + 1) * blocks] for i in range(n)]
        firsts, want = prefill_then_greedy([eager, graphed], prompts, tables, lookahead)
        g = _Graph(None, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),  # type: ignore[arg-type]
                   torch.full((rows, blocks), 95, dtype=torch.int64), torch.zeros(lookahead, rows, dtype=torch.int64),
                   torch.zeros(rows, config.vocab_size))
        g.tokens[:n] = torch.tensor(firsts)
        g.positions[:n] = torch.tensor([len(p) for p in prompts])
        for i, t in enumerate(tables):
            g.tables[i, : len(t)] = torch.tensor(t)
        with torch.inference_mode():
            decoder._step(g)
        assert g.out_tokens[:, :n].tolist() == want


def test_graph_decoder_refuses_a_cpu_model() -> None:
    from tandem.cuda.graphs import GraphDecoder

    config = tiny_config()
    model = LlamaModel(config, random_weights(config), make_backend("torch", config.num_heads))
    with pytest.raises(ValueError, match="CUDA"):
        GraphDecoder(model, KVPool.create(KVPoolSpec.for_model(config, 8, 16)), scratch_block=7)


def test_context_buckets_cover_every_length_with_bounded_padding() -> None:
    from tandem.cuda.graphs import context_buckets

    rng = random.Random(5)
    for _ in range(200):
        max_blocks, first = rng.randrange(1, 3000), rng.choice([1, 8, 16, 32])
        buckets = context_buckets(max_blocks, first)
        assert buckets[-1] == max_blocks and list(buckets) == sorted(set(buckets))
        for need in rng.sample(range(1, max_blocks + 1), min(max_blocks, 20)):
            b = next(b for b in buckets if b >= need)
            assert b <= max(first, 1.5 * need + first), (need, b)  # the padding stays bounded
    with pytest.raises(ValueError):
        context_buckets(0)


class _RecordingGraphs:
    """Stands in for tandem.cuda.graphs.ServiceGraphs, which needs a GPU: records what decode_svc
    hands a graph step, returns logits of the right shape, or raises when told to."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[list[int], list[int], list[list[int]]]] = []
        self.fail = fail

    def logits(self, tokens, seq_lens, tables):  # type: ignore[no-untyped-def]
        if self.fail:
            raise RuntimeError("capture failed")
        self.calls.append((list(tokens), list(seq_lens), [list(t) for t in tables]))
        return torch.zeros(len(tokens), 8)


def test_decode_svc_hands_only_single_token_rows_to_graphs_and_falls_back_for_good_on_a_failure() -> None:
    from types import SimpleNamespace

    from decode_svc.server import DecodeWorker
    from tandem.engine.sampling import SamplingParams
    from tandem.engine.step import Request

    rng = random.Random(9)
    for _ in range(30):
        reqs = []
        for i in range(rng.randrange(1, 6)):
            req = Request(f"r{i}", [rng.randrange(100) for _ in range(rng.randrange(1, 20))], SamplingParams(), None)
            req.output_token_ids = [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
            n = len(req.all_token_ids)
            req.num_computed_tokens = n - 1 if rng.random() < 0.8 else rng.randrange(0, n - 1) if n > 1 else 0
            req.block_ids = rng.sample(range(50), -(-n // 16))
            reqs.append(req)
        worker = SimpleNamespace(graphs=_RecordingGraphs(), _graph_failed=False, service_id="d")
        out = DecodeWorker._graph_logits(worker, reqs)  # type: ignore[arg-type]
        single = all(r.num_computed_tokens == len(r.all_token_ids) - 1 for r in reqs)
        assert (out is not None) == single
        if single:
            assert worker.graphs.calls == [([r.output_token_ids[-1] for r in reqs], [len(r.all_token_ids) for r in reqs],
                                            [r.block_ids for r in reqs])]
    failing = SimpleNamespace(graphs=_RecordingGraphs(fail=True), _graph_failed=False, service_id="d")
    req = Request("r", [1, 2], SamplingParams(), None)
    req.output_token_ids, req.num_computed_tokens, req.block_ids = [3], 2, [0]
    assert DecodeWorker._graph_logits(failing, [req]) is None and failing._graph_failed  # type: ignore[arg-type]
    failing.graphs.fail = False
    assert DecodeWorker._graph_logits(failing, [req]) is None and not failing.graphs.calls  # type: ignore[arg-type]


def _hybrid_batches(rng: random.Random, num_blocks: int):  # type: ignore[no-untyped-def]
    """Random batches over one pool: prompts prefilled whole or in chunks, then decode rows and
    chunks mixed (hybrid), each sequence on blocks of its own; yields (batch, note)."""
    per_seq = 8
    n = rng.randrange(1, 5)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(2, 100))] for _ in range(n)]
    perm = rng.sample(range(num_blocks), n * per_seq)
    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(n)]
    done = [0] * n
    toks: list[list[int]] = [[] for _ in range(n)]
    for _ in range(6):
        batch, who = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                take = min(rng.randrange(1, 40), len(p) - done[i])
                batch.append(SeqInput(p[done[i]:done[i] + take], done[i], tables[i], done[i] + take == len(p)))
                who.append((i, take))
            elif len(p) + len(toks[i]) < per_seq * 16 - 1:
                last = toks[i][-1] if toks[i] else p[-1]
                batch.append(SeqInput([last], len(p) + len(toks[i]) - (0 if toks[i] else 1), tables[i]))
                who.append((i, 0))
        if not batch:
            return
        yield batch, who
        for i, take in who:
            if take:
                done[i] += take
            else:
                toks[i].append(rng.randrange(512))


def test_piecewise_pieces_equal_the_layers_run_whole_on_hybrid_batches() -> None:
    """tandem.cuda.piecewise without graphs (the pieces run eagerly over the static buffers):
    a runner whose forward goes through them gives the logits of one that runs its layers
    whole, over random prefill, chunked, decode and hybrid batches; a batch over the largest
    bucket runs op by op."""
    from tandem.cuda.piecewise import PiecewiseForward

    total_used = total_hybrid = 0
    for seed in range(4):
        rng = random.Random(seed)
        whole, piecewise = tiny_random_runner("cpu", seed), tiny_random_runner("cpu", seed)
        piecewise.piecewise = PiecewiseForward(piecewise.model, piecewise.pool, buckets=(8, 32, 64), capture=False)
        used = hybrid = 0
        for batch, who in _hybrid_batches(rng, 96):
            tokens = sum(len(s.token_ids) for s in batch)
            used += tokens <= 64
            hybrid += any(take for _, take in who) and any(not take for _, take in who)
            want, got = whole.forward(batch), piecewise.forward(batch)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert piecewise.piecewise.num_steps == used
        total_used, total_hybrid = total_used + used, total_hybrid + hybrid
    assert total_used and total_hybrid  # the seeds gave piecewise steps and hybrid batches
    with pytest.raises(ValueError, match="CUDA device"):
        PiecewiseForward(whole.model, whole.pool)


def test_a_failing_piecewise_capture_turns_the_pieces_off_and_the_step_runs_op_by_op() -> None:
    from tandem.cuda.piecewise import PiecewiseForward

    whole, runner = tiny_random_runner("cpu", 2), tiny_random_runner("cpu", 2)
    pieces = runner.piecewise = PiecewiseForward(runner.model, runner.pool, buckets=(64,), capture=False)

    def fail(tokens, stream):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory while capturing")

    pieces._make = fail  # type: ignore[method-assign]
    batch = [SeqInput(list(range(1, 20)), 0, [0, 1])]
    torch.testing.assert_close(runner.forward(batch), whole.forward(batch))
    assert pieces.failed and pieces.num_steps == 0 and not pieces.ready(8)


def test_flashinfer_step_layouts_name_each_steps_context_and_slot() -> None:
    """The host's plan of look-ahead graph steps for flashinfer: step s of row i attends over
    ``seq_lens[i] + s`` tokens of its table and writes its token at position ``seq_lens[i] - 1 + s``;
    padding rows use the scratch block alone."""
    from tandem.cuda.graphs import step_layouts
    from tandem.engine.kv_pool import slot_ids

    rng = random.Random(3)
    for _ in range(200):
        bs = rng.choice([1, 4, 16])
        k = rng.randrange(1, min(bs, 4) + 1)  # GraphDecoder keeps padding rows within the scratch block
        n = rng.randrange(1, 7)
        rows = n + rng.randrange(0, 4)
        scratch = 999
        lens = [rng.randrange(1, 80) for _ in range(n)]
        tables = [rng.sample(range(900), -(-(length - 1 + k) // bs) + rng.randrange(0, 3)) for length in lens]
        layouts, slots = step_layouts(lens, tables, rows, k, bs, scratch)
        assert len(layouts) == len(slots) == k
        for s, (layout, step_slots) in enumerate(zip(layouts, slots)):
            assert layout.batch_size == rows and len(step_slots) == rows
            want_lens = [length + s for length in lens] + [s + 1] * (rows - n)
            assert layout.seq_lens() == want_lens
            for i in range(rows):
                table = tables[i] if i < n else [scratch]
                assert layout.block_table(i) == table[: -(-want_lens[i] // bs)]
                assert step_slots[i] == slot_ids(table, want_lens[i] - 1, want_lens[i], bs)[0]


def test_graph_attention_choice_says_why_flashinfer_cannot_serve() -> None:
    from tandem.cuda.graphs import resolve_graph_attention

    config = tiny_config()
    pools = {
        "fp32": KVPool.create(KVPoolSpec.for_model(config, 4, 16)),
        "block": KVPool.create(KVPoolSpec.for_model(config, 4, 16, torch.bfloat16, layout="block")),
        "bf16": KVPool.create(KVPoolSpec.for_model(config, 4, 16, torch.bfloat16)),
    }
    assert resolve_graph_attention("torch", pools["bf16"], torch.bfloat16) == ("torch", "asked for")
    reasons = {name: resolve_graph_attention("auto", pool, torch.bfloat16) for name, pool in pools.items()}
    assert reasons["fp32"][0] == "torch" and "fp16 or bf16" in reasons["fp32"][1]
    assert reasons["block"][0] == "torch" and "layout" in reasons["block"][1]
    assert "fp16 or bf16" in resolve_graph_attention("auto", pools["bf16"], torch.float16)[1]  # model and pool differ
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        assert reasons["bf16"] == ("torch", reasons["bf16"][1]) and "not importable" in reasons["bf16"][1]
        with pytest.raises(ValueError, match="--cuda-attention flashinfer: flashinfer is not importable"):
            resolve_graph_attention("flashinfer", pools["bf16"], torch.bfloat16)
    else:
        assert reasons["bf16"][0] == "flashinfer"
    with pytest.raises(ValueError, match="fp16 or bf16"):
        resolve_graph_attention("flashinfer", pools["fp32"], torch.float32)
    with pytest.raises(ValueError, match="unknown --cuda-attention"):
        resolve_graph_attention("cutlass", pools["bf16"], torch.bfloat16)
    with pytest.raises(ValueError, match="--cuda-eager-attention flashinfer: flashinfer needs fp16 or bf16"):
        resolve_graph_attention("flashinfer", pools["fp32"], torch.float32, "--cuda-eager-attention")


def test_decode_svc_takes_the_graph_attention_flag() -> None:
    from decode_svc.config import parse_args
    from tandem.cuda import CUDA_ATTENTION

    for choice in CUDA_ATTENTION:  # every choice the resolver takes, the flag takes
        assert parse_args(["--cuda-attention", choice]).cuda_attention == choice
    assert parse_args([]).cuda_attention == "auto"
    assert parse_args(["--cuda-attention", "torch"]).cuda_attention == "torch"
    with pytest.raises(SystemExit):
        parse_args(["--cuda-attention", "cutlass"])


def test_both_services_take_the_eager_attention_flag() -> None:
    from decode_svc.config import parse_args as decode_args
    from prefill_svc.config import parse_args as prefill_args
    from tandem.cuda import CUDA_ATTENTION

    for parse in (decode_args, prefill_args):
        base = ["--decode-address", "127.0.0.1:1"] if parse is prefill_args else []
        assert parse(base).cuda_eager_attention == "auto"  # flashinfer where it serves: measured live
        for choice in CUDA_ATTENTION:  # every choice the resolver takes (the graph steps' too)
            assert parse([*base, "--cuda-eager-attention", choice]).cuda_eager_attention == choice
        with pytest.raises(SystemExit):
            parse([*base, "--cuda-eager-attention", "cutlass"])


class _PrefillWrapperStandIn:
    """A stand-in for ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (flashinfer runs on CUDA
    only): it keeps what it was last planned for and answers ``run`` with that. Only which
    wrapper a plan runs on is under test; flashinfer's kernels are checked on a GPU (tests/gpu)."""

    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        self.workspace, self.planned = workspace, None

    def plan(self, qo_indptr: torch.Tensor, *args: object, **kwargs: object) -> None:
        self.planned = qo_indptr.tolist()

    def run(self, q: torch.Tensor, cache: object) -> torch.Tensor:
        return torch.full_like(q, float(self.planned[-1]))


def test_each_live_flashinfer_plan_keeps_its_own_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch paused between layer groups keeps its plan while a preempting batch plans and runs
    (prefill_svc's MuxWise preemption): each plan runs on a wrapper of its own, all on one
    workspace, and a wrapper whose plan was dropped is taken again rather than a new one made."""
    import gc
    import sys
    import types

    from tandem.engine.attention import SeqSpan
    from tandem.engine.attention_flashinfer import FlashInferAttention

    def batch_indices_positions(qo_indptr: torch.Tensor, seq_lens: torch.Tensor, n: int):  # type: ignore[no-untyped-def]
        return torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)

    stand_in = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_PrefillWrapperStandIn,
                                     get_batch_indices_positions=batch_indices_positions,
                                     append_paged_kv_cache=lambda *args, **kwargs: None)
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    rng = random.Random(5)
    config = tiny_config()
    pool = KVPool.create(KVPoolSpec.for_model(config, 32, 16, torch.bfloat16))
    backend = FlashInferAttention(config.num_heads, device="cpu")
    live: list[tuple[object, int]] = []
    peak = 0
    for _ in range(40):
        if live and rng.random() < 0.5:  # a batch ends: its plan is dropped
            live.pop(rng.randrange(len(live)))
            gc.collect()
        else:
            tokens = rng.randrange(1, 300)
            blocks = rng.sample(range(32), -(-tokens // 16))
            live.append((backend.plan([SeqSpan(0, tokens, 0, blocks)], pool), tokens))
        wrappers = [plan.wrapper for plan, _ in live]  # type: ignore[attr-defined]
        assert len({id(w) for w in wrappers}) == len(wrappers)  # no two live plans share one
        assert all(w.workspace is backend._workspace for w in wrappers)
        peak = max(peak, len(live))
        assert backend.num_wrappers <= peak  # a dropped plan's wrapper is taken again
        q = torch.zeros(2, config.num_heads, config.head_dim)
        for plan, tokens in live:  # every paused batch still runs on its own plan
            assert float(backend.forward(0, q, q, q, plan, pool)[0, 0, 0]) == tokens
    assert backend.num_wrappers == len(live) + len(backend._free)


class _BufferedWrapperStandIn(_PrefillWrapperStandIn):
    """As ``_PrefillWrapperStandIn``, and like flashinfer 0.5.3's wrapper it allocates a buffer
    once, when built, and copies each plan's lengths into it (``_kv_lens_buffer``): torch's rule on
    inference tensors is what is under test, and it is the same on CPU and CUDA."""

    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        super().__init__(workspace, layout)
        self._kv_lens_buffer = torch.zeros(64, dtype=torch.int32)

    def plan(self, qo_indptr: torch.Tensor, *args: object, **kwargs: object) -> None:
        super().plan(qo_indptr)
        lens = qo_indptr[1:] - qo_indptr[:-1]
        self._kv_lens_buffer[: len(lens)].copy_(lens)


def test_flashinfer_plans_in_and_out_of_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper first planned by ``ModelRunner.forward`` (inference mode) and planned again by
    prefill_svc's ``begin`` (which ran outside it) failed its copy on an H200 ("Inplace update to
    inference tensor outside InferenceMode"): plans in either mode, in random order, on recycled
    wrappers, all plan, and ``ModelRunner.begin`` runs in inference mode as ``forward`` does."""
    import gc
    import sys
    import types

    from tandem.engine.attention import SeqSpan
    from tandem.engine.attention_flashinfer import FlashInferAttention
    from tandem.engine.runner import ModelRunner

    stand_in = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_BufferedWrapperStandIn,
        get_batch_indices_positions=lambda qo, lens, n: (torch.zeros(n, dtype=torch.int32),) * 2,
        append_paged_kv_cache=lambda *args, **kwargs: None)
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    config = tiny_config()
    pool = KVPool.create(KVPoolSpec.for_model(config, 32, 16, torch.bfloat16))
    backend = FlashInferAttention(config.num_heads, device="cpu")
    rng = random.Random(11)
    for _ in range(30):
        tokens = rng.randrange(1, 200)
        spans = [SeqSpan(0, tokens, 0, rng.sample(range(32), -(-tokens // 16)))]
        if rng.random() < 0.5:
            with torch.inference_mode():
                plan = backend.plan(spans, pool)
        else:
            plan = backend.plan(spans, pool)
        assert plan.wrapper.planned == [0, tokens]
        del plan
        gc.collect()  # the wrapper goes back to the free ones, to be planned in the other mode next
    assert backend.num_wrappers == 1
    assert getattr(ModelRunner.begin, "__wrapped__", None) is not None  # torch.inference_mode's decorator


class _PagedDecodeReference:
    """A stand-in for one planned ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (flashinfer
    runs on CUDA only): ``run`` attends each row's query over the first ``seq_len`` tokens of its
    CSR block list, in plain torch. Only the host's planning and the step's wiring are under test
    here; flashinfer's own kernel is checked against torch's attention on a GPU (tests/gpu)."""

    def __init__(self, layout) -> None:  # type: ignore[no-untyped-def]
        self.layout = layout

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k_cache, v_cache = cache
        bs, kvh, d = k_cache.shape[1:]
        group = q.shape[1] // kvh
        out = torch.empty_like(q)
        for b, length in enumerate(self.layout.seq_lens()):
            blocks = torch.tensor(self.layout.block_table(b))
            k = k_cache[blocks].reshape(-1, kvh, d)[:length].repeat_interleave(group, dim=1)  # [L, H, d]
            v = v_cache[blocks].reshape(-1, kvh, d)[:length].repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), k.float()) / d ** 0.5, dim=-1)
            out[b] = torch.einsum("hl,lhd->hd", weights, v.float()).to(q.dtype)
        return out


@pytest.mark.parametrize("lookahead", [1, 4])
def test_the_flashinfer_step_wiring_equals_eager_decode(lookahead: int) -> None:
    """The graph step with flashinfer's attention: each look-ahead step writes its token at the
    slot ``step_layouts`` names and attends through that step's planned wrapper (here a plain
    torch reference of paged decode), padding rows on the scratch block: eager decode's tokens."""
    from tandem.cuda.graphs import FlashInferGraphAttention, _Graph, step_layouts

    rng = random.Random(40 + lookahead)
    config = tiny_config()
    eager, graphed = tiny_random_runner(seed=4), tiny_random_runner(seed=4)
    decoder = _step_decoder(graphed, lookahead, FlashInferGraphAttention())
    for _ in range(4):
        n, rows = rng.randrange(1, 7), 8
        prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randrange(3, 110))] for _ in range(n)]
        need = [-(-(len(p) + lookahead) // 16) for p in prompts]  # blocks for the prompt and look-ahead
        perm = rng.sample(range(88), sum(need))
        tables = [[perm.pop() for _ in range(k)] for k in need]
        firsts, want = prefill_then_greedy([eager, graphed], prompts, tables, lookahead)
        layouts, slots = step_layouts([len(p) + 1 for p in prompts], tables, rows, lookahead, 16, 95)
        g = _Graph(None, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),  # type: ignore[arg-type]
                   torch.full((rows, 1), 95, dtype=torch.int64), torch.zeros(lookahead, rows, dtype=torch.int64),
                   torch.zeros(rows, config.vocab_size), torch.tensor(slots, dtype=torch.int64),
                   [_PagedDecodeReference(layout) for layout in layouts])
        g.tokens[:n] = torch.tensor(firsts)
        g.positions[:n] = torch.tensor([len(p) for p in prompts])
        with torch.inference_mode():
            decoder._step(g)
        assert g.out_tokens[:, :n].tolist() == want
