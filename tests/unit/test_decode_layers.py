"""A decode step's layers run whole in C (``ggml_kernels.DecodeLayers``, the ``ggml`` format's
decode rows) against the same layers run op by op (``TANDEM_CPU_KERNELS=ops``), on random tiny
models whose projections Q4_1 / Q8_0 hold exactly: GQA shapes, qkv bias, both pool layouts,
block sizes, 1-6 rows of mixed contexts, layer groups. Both paths run the same ggml dot products
on activations quantized to 8 bits; rope and silu round differently in C (about 1e-7), which can
move an activation across an 8-bit rounding boundary, so logits agree to a small fraction of
their spread rather than bit for bit. The K/V written to the pool agree to fp32 rounding.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine import ggml_kernels, quant
from tandem.engine.attention import TorchPagedAttention, make_backend
from tandem.engine.config import ModelConfig
from tandem.engine.ggml_kernels import GgmlType
from tandem.engine.kv_pool import KVPool, KVPoolSpec, PagedLayout
from tandem.engine.model import (DECODE_LAYERS_MAX_ROWS, DECODE_LAYERS_X8_MAX_ROWS, WHOLE_LAYERS_BF16_PROMPT_ROWS,
                                 WHOLE_LAYERS_VNNI_PROMPT_ROWS, LlamaModel)
from tandem.engine.random_weights import random_weights
from tandem.engine.runner import ModelRunner, SeqInput
from tandem.engine.weight_format import WeightFormat


SHAPES = [(3, 1, 32), (4, 2, 32), (2, 2, 48), (6, 3, 16)]  # query heads, kv heads, head dim


@pytest.fixture(scope="module", autouse=True)
def kernels() -> ggml_kernels.Kernels:
    return ggml_kernels.require()


def _model(heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm: bool, seed: int,
           gtypes: tuple[GgmlType, ...] = (GgmlType.Q4_1, GgmlType.Q8_0)) -> LlamaModel:
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=96, intermediate_size=160, num_layers=3,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, qkv_bias=bias, qk_norm=qk_norm)
    weights = random_weights(config, seed=seed, std=0.15)
    kern = ggml_kernels.load()
    assert kern is not None
    for i, name in enumerate(n for n in weights if n.endswith("_proj") or n == "lm_head"):
        gtype = gtypes[i % len(gtypes)]  # by default both kinds of activation blocks (Q8_1, Q8_0)
        w = weights[name]
        weights[name] = kern.dequantize(kern.quantize(w, gtype), gtype, *w.shape)
    return LlamaModel(config, weights, make_backend("torch", heads), WeightFormat.GGML)


def _step(runner: ModelRunner, batch: list[SeqInput], mode: str, monkeypatch: pytest.MonkeyPatch,
          groups: list[int] | None = None) -> torch.Tensor:
    monkeypatch.setenv("TANDEM_CPU_KERNELS", mode)
    # op by op, every row count of the comparison runs ggml's kernels (not the fp16 copy)
    monkeypatch.setattr(quant, "GGML_MAX_ROWS", DECODE_LAYERS_MAX_ROWS)
    monkeypatch.setattr(quant, "GGML_X8_MAX_ROWS", DECODE_LAYERS_X8_MAX_ROWS)
    state = runner.begin(batch)
    for end in groups or [runner.num_layers]:
        runner.run_layers(state, end)
    return runner.finish(state)


def _compare(heads_kv_d: tuple[int, int, int], bias: bool, layout: str, block_size: int, rows: int, groups: bool,
             seed: int, kv_dtype: torch.dtype = torch.float32,
             gtypes: tuple[GgmlType, ...] = (GgmlType.Q4_1, GgmlType.Q8_0)) -> tuple[float, float]:
    """One random decode step both ways from the same pool; returns the largest difference of the
    later layers' K/V and of the logits, each over its largest magnitude."""
    monkeypatch = pytest.MonkeyPatch()
    heads, kv_heads, head_dim = heads_kv_d
    model = _model(heads, kv_heads, head_dim, bias, False, seed, gtypes)
    assert model._whole_layers is not None
    rng = random.Random(seed)
    num_blocks = rows * (300 // block_size + 2) + 3
    pool = KVPool.create(KVPoolSpec.for_model(model.config, num_blocks, block_size, kv_dtype, layout=layout))
    runner = ModelRunner(model, pool)
    free = list(range(num_blocks))
    rng.shuffle(free)
    batch = []
    for _ in range(rows):
        ctx = rng.randint(0, 250)
        blocks = [free.pop() for _ in range(ctx // block_size + 1)]
        if ctx:
            runner.forward([SeqInput([rng.randrange(256) for _ in range(ctx)], 0, blocks)])
        batch.append(SeqInput((rng.randrange(256),), ctx, blocks))
    layer_groups = sorted({rng.randint(0, 3), 3}) if groups else None
    snapshot = pool.tensor.clone()
    try:
        ops = _step(runner, batch, "ops", monkeypatch, layer_groups)
        pool_ops = KVPool(pool.spec, pool.tensor.clone())
        pool.tensor.copy_(snapshot)
        calls = []
        run = model._whole_layers.run
        monkeypatch.setattr(model._whole_layers, "run", lambda *a: calls.append(a) or run(*a))
        whole = _step(runner, batch, "c", monkeypatch, layer_groups)
    finally:
        monkeypatch.undo()
    assert calls, "the whole-layer path did not run"
    # layer 0's K/V come from the same inputs on both paths: equal to fp32 rounding (rope's), which
    # may tip a value to the neighbouring fp16 / bf16 number
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[kv_dtype]
    torch.testing.assert_close(pool.k_cache(0), pool_ops.k_cache(0), atol=tol, rtol=tol)
    torch.testing.assert_close(pool.v_cache(0), pool_ops.v_cache(0), atol=tol, rtol=tol)
    layer_error = 0.0
    for later in range(1, model.config.num_layers):
        ours, ref = (torch.stack([p.k_cache(later), p.v_cache(later)]).float() for p in (pool, pool_ops))
        layer_error = max(layer_error, float((ours - ref).abs().max() / ref.abs().max()))
    return layer_error, float((whole - ops).abs().max() / ops.abs().max())


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(SHAPES), st.booleans(), st.sampled_from(["layer", "block"]), st.sampled_from([1, 5, 16]),
       st.integers(1, DECODE_LAYERS_MAX_ROWS), st.booleans(),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.integers(0, 2**31))
def test_whole_layers_equal_the_op_by_op_step(heads_kv_d: tuple[int, int, int], bias: bool, layout: str,
                                              block_size: int, rows: int, groups: bool, kv_dtype: torch.dtype,
                                              seed: int) -> None:
    """Within 5 % of the largest magnitude (measured over 400 examples on an fp32 pool: at most
    1.1 % for K/V, 2 % for logits): an 8-bit rounding boundary crossed upstream moves them a
    little; a wrong row, position or context moves them by about their size. fp16 and bf16 pools
    hold the same bound: both paths round the same K/V into the pool."""
    layer_error, logit_error = _compare(heads_kv_d, bias, layout, block_size, rows, groups, seed, kv_dtype)
    assert layer_error <= 0.05 and logit_error <= 0.05, (layer_error, logit_error)


def test_most_steps_agree_bit_for_bit() -> None:
    """Rounding differences cross an 8-bit boundary rarely: over random steps, most logits are
    bit-identical (measured: over 95 % of 400), which no systematic slip would leave."""
    rng = random.Random(20261126)
    exact = 0
    for _ in range(40):
        _, logit_error = _compare(rng.choice(SHAPES), rng.random() < 0.5, rng.choice(["layer", "block"]),
                                  rng.choice([1, 5, 16]), rng.randint(1, DECODE_LAYERS_MAX_ROWS), rng.random() < 0.5,
                                  rng.randrange(2**31))
        exact += logit_error == 0.0
    assert exact >= 30, exact


def test_repacked_layers_run_whole_at_more_rows_and_agree() -> None:
    """A model whose projections are all Q4 (repacked for ggml's gemm: 4-row groups and single
    rows both) runs whole layers up to DECODE_LAYERS_X8_MAX_ROWS rows, within the same bound of
    the op-by-op step and mostly bit for bit (both run the same gemm on the same 8-bit rows)."""
    assert _model(4, 2, 32, False, False, 1, (GgmlType.Q4_1, GgmlType.Q4_0))._whole_layers.repacked
    assert not _model(4, 2, 32, False, False, 1)._whole_layers.repacked  # Q8_0 projections stay plain
    rng = random.Random(20261127)
    exact = 0
    for trial in range(12):
        rows = rng.choice([1, 3, 4, 7, 13, DECODE_LAYERS_X8_MAX_ROWS]) if trial else DECODE_LAYERS_X8_MAX_ROWS
        layer_error, logit_error = _compare(rng.choice(SHAPES), rng.random() < 0.5, rng.choice(["layer", "block"]),
                                            rng.choice([1, 5, 16]), rows, rng.random() < 0.5, rng.randrange(2**31),
                                            gtypes=(GgmlType.Q4_1, GgmlType.Q4_0))
        assert layer_error <= 0.05 and logit_error <= 0.05, (rows, layer_error, logit_error)
        exact += logit_error == 0.0
    assert exact >= 8, exact


def test_other_steps_and_models_run_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows than the whole-layer path takes (prompt rows count), the path turned off, a
    model with q/k norms and formats other than ggml all keep the op-by-op layers."""
    model = _model(4, 2, 32, False, False, 7)
    whole = model._whole_layers
    assert whole is not None
    calls: list[object] = []
    run = whole.run
    monkeypatch.setattr(whole, "run", lambda *a: calls.append(a) or run(*a))
    rows = DECODE_LAYERS_MAX_ROWS + 1
    pool = KVPool.create(KVPoolSpec.for_model(model.config, 4 * rows, 16))
    runner = ModelRunner(model, pool)
    decode = [SeqInput((3,), 20, [4 * i, 4 * i + 1]) for i in range(rows)]
    runner.forward(decode[:1] + [SeqInput(tuple(range(1, rows)), 0, [4 * rows - 1])])  # prompt rows: one too many
    runner.forward(decode)  # one row too many
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "ops")
    runner.forward(decode[:2])
    runner.forward(decode[:1] + [SeqInput((1, 2, 3), 0, [4 * rows - 1])])
    assert not calls
    monkeypatch.delenv("TANDEM_CPU_KERNELS")
    runner.forward(decode[:2])
    runner.forward(decode[:1] + [SeqInput((1, 2, 3), 0, [4 * rows - 1])])  # a prompt beside a decode row: whole
    assert len(calls) == 2
    assert _model(4, 2, 32, False, True, 7)._whole_layers is None  # Qwen3's per-head q/k norms
    fp16 = LlamaModel(model.config, model.weights, make_backend("torch", 4), WeightFormat.FP16)
    assert fp16._whole_layers is None


def test_prompt_rows_stay_a_chunk_where_attention_is_not_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt tokens become single-token rows only for attention that plans them on the C kernel:
    a backend without it gets the chunk as one causal span (SDPA), not one torch decode row each."""
    model = _model(4, 2, 32, False, False, 5)
    whole = model._whole_layers
    assert whole is not None
    pool = KVPool.create(KVPoolSpec.for_model(model.config, 8, 16))
    batch = [SeqInput((3,), 20, [0, 1]), SeqInput((1, 2, 3, 4), 0, [2])]
    for backend, expanded in ((TorchPagedAttention(c_decode=True), True), (TorchPagedAttention(c_decode=False), False)):
        assert backend.decodes_in_c(pool) is expanded
        monkeypatch.setattr(model, "attention", backend)
        calls: list[object] = []
        run = whole.run
        monkeypatch.setattr(whole, "run", lambda *a, run=run, calls=calls: calls.append(a) or run(*a))
        runner = ModelRunner(model, pool)
        state = runner.begin(batch)
        assert (not state.attn_meta.prefill) is expanded
        runner.run_layers(state)
        assert len(calls) == int(expanded)
        monkeypatch.undo()


@pytest.mark.parametrize("wide", [WeightFormat.FP16, WeightFormat.BF16])
@pytest.mark.parametrize("prompt_len", [WHOLE_LAYERS_BF16_PROMPT_ROWS, WHOLE_LAYERS_BF16_PROMPT_ROWS + 1, 90,
                                        DECODE_LAYERS_X8_MAX_ROWS, DECODE_LAYERS_X8_MAX_ROWS + 1,
                                        WHOLE_LAYERS_VNNI_PROMPT_ROWS])
@pytest.mark.parametrize("num_decode", [0, 3])
def test_long_prompt_steps_run_op_by_op_beside_a_bf16_wide_copy(wide: WeightFormat, prompt_len: int,
                                                                num_decode: int) -> None:
    """Where the wide copy is bf16 (a CPU with a bf16 dot product), a step of more prompt tokens than
    WHOLE_LAYERS_BF16_PROMPT_ROWS runs op by op (its projections on the bf16 copy, faster there),
    or than WHOLE_LAYERS_VNNI_PROMPT_ROWS on Tandem's VNNI kernel without AMX; with the fp16 copy it
    stays whole in C up to the row cap; decode rows alone stay whole."""
    model = _model(4, 2, 32, False, False, 11, (GgmlType.Q4_1, GgmlType.Q4_0))
    assert model._whole_layers is not None and model._whole_layers.repacked
    model.wide_format = wide  # what quant.ggml_wide_format picked on the CPU it loaded on
    pool = KVPool.create(KVPoolSpec.for_model(model.config, 10 + prompt_len // 16, 16))
    runner = ModelRunner(model, pool)
    rng = random.Random(prompt_len + num_decode)
    batch = [SeqInput((rng.randrange(256),), 5, [2 * i]) for i in range(num_decode)]
    batch.append(SeqInput(tuple(rng.randrange(256) for _ in range(prompt_len)), 0,
                          list(range(8, 9 + prompt_len // 16))))
    cap = model.whole_layers_max_rows()  # DECODE_LAYERS_X8_MAX_ROWS, or WHOLE_LAYERS_VNNI_MAX_ROWS on our VNNI or AVX2 kernel
    whole = num_decode + prompt_len <= cap and (wide == WeightFormat.FP16 or prompt_len <= model.whole_layers_prompt_rows())
    assert model.whole_layer_rows(num_decode + prompt_len, pool, prompt_len) is whole
    assert (not runner.begin(batch).attn_meta.prefill) is whole
    # as many decode rows alone: whole up to the row cap
    assert model.whole_layer_rows(num_decode + prompt_len, pool) is (num_decode + prompt_len <= cap)
    # one row or prompt token past either cap (longer than this model's context): op by op
    assert not model.whole_layer_rows(cap + 1, pool)
    assert not model.whole_layer_rows(model.whole_layers_prompt_rows() + 1, pool, model.whole_layers_prompt_rows() + 1) \
        or wide == WeightFormat.FP16


def test_a_pool_the_kernel_cannot_read_is_refused() -> None:
    model = _model(4, 2, 32, False, False, 3)
    assert model._whole_layers is not None
    pool = KVPool.create(KVPoolSpec.for_model(model.config, 4, 16, torch.bfloat16))
    layout = PagedLayout.build([[0]], [5], 8)  # the table's blocks are not the pool's
    cos = sin = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="pool of contiguous"):
        model._whole_layers.run(0, 3, torch.zeros(1, 96), cos, sin, torch.tensor([4]), pool, layout)
    with pytest.raises(ValueError, match="layers"):
        model._whole_layers.run(0, 4, torch.zeros(1, 96), cos, sin, torch.tensor([4]), pool, layout)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SHAPES), st.booleans(), st.sampled_from([1, 5, 16]), st.booleans(), st.integers(0, 4),
       st.lists(st.tuples(st.integers(0, 120), st.integers(1, 9)), min_size=1, max_size=3), st.integers(0, 2**31))
def test_prompt_rows_run_whole_as_the_same_tokens_decoded_one_by_one(
        heads_kv_d: tuple[int, int, int], bias: bool, block_size: int, repacked: bool, num_decode: int,
        prompts: list[tuple[int, int]], seed: int) -> None:
    """A step carrying prompt chunks (each after its own cached prefix) beside decode rows, few
    enough rows to run whole in C, computes each chunk token as a decode row of its sequence at its
    position: its hidden state and the K/V it writes are bit for bit those of the same tokens fed
    as decode steps one at a time, the earlier tokens of the chunk seen through the pool (causal)."""
    heads, kv_heads, head_dim = heads_kv_d
    gtypes = (GgmlType.Q4_1, GgmlType.Q4_0) if repacked else (GgmlType.Q4_1, GgmlType.Q8_0)
    model = _model(heads, kv_heads, head_dim, bias, False, seed % 1000, gtypes)
    assert model._whole_layers is not None
    cap = model.whole_layers_max_rows()
    prompt_cap = model.whole_layers_prompt_rows() if model.wide_format == WeightFormat.BF16 else cap
    rng = random.Random(seed)
    chunks = [(cached, rng.randint(1, length)) for cached, length in prompts]
    num_decode = min(num_decode, cap - 1)
    while num_decode + sum(n for _, n in chunks) > cap or sum(n for _, n in chunks) > prompt_cap:
        chunks.pop()
    if not chunks:
        chunks = [(rng.randint(0, 120), min(cap - num_decode, prompt_cap))]
    seqs = [(rng.randint(0, 120), 1) for _ in range(num_decode)] + chunks
    _assert_step_is_its_rows_one_by_one(model, seqs, block_size, rng)


def _assert_step_is_its_rows_one_by_one(model: LlamaModel, seqs: list[tuple[int, int]], block_size: int,
                                        rng: random.Random) -> None:
    """One step of ``seqs`` ((cached, new tokens) each, after its cached prefix) runs whole in C,
    and each of its rows' hidden states and the K/V it writes are bit for bit those of a twin
    sequence fed the same tokens as decode steps one at a time."""
    per_seq = (max(cached + n for cached, n in seqs) + 1) // block_size + 2
    num_blocks = 2 * len(seqs) * per_seq
    pool = KVPool.create(KVPoolSpec.for_model(model.config, num_blocks, block_size))
    runner = ModelRunner(model, pool)
    tokens = [[rng.randrange(256) for _ in range(cached + n)] for cached, n in seqs]
    tables = [list(range(2 * i * per_seq, (2 * i + 1) * per_seq)) for i in range(len(seqs))]
    twins = [list(range((2 * i + 1) * per_seq, (2 * i + 2) * per_seq)) for i in range(len(seqs))]
    for (cached, _), ids, a, b in zip(seqs, tokens, tables, twins, strict=True):
        if cached:
            for blocks in (a, b):
                runner.forward([SeqInput(ids[:cached], 0, blocks)])
    calls: list[object] = []
    run = model._whole_layers.run
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(model._whole_layers, "run", lambda *a: calls.append(a) or run(*a))
    try:
        state = runner.begin([SeqInput(ids[cached:], cached, blocks)
                              for (cached, _), ids, blocks in zip(seqs, tokens, tables, strict=True)])
        runner.run_layers(state)
    finally:
        monkeypatch.undo()
    assert len(calls) == 1, "the step did not run whole in C"
    # the rows are the threads' to split only when each is a sequence of its own (DecodeLayers.run)
    assert calls[0][-1] is all(n == 1 for _, n in seqs)
    row = 0
    for (cached, n), ids, a, b in zip(seqs, tokens, tables, twins, strict=True):
        for i in range(n):  # the twin sequence: the same tokens, one decode step each
            one = runner.begin([SeqInput([ids[cached + i]], cached + i, b)])
            runner.run_layers(one)
            assert torch.equal(state.hidden[row], one.hidden[0]), (row, cached, i)
            row += 1
        slots_a = [a[p // block_size] * block_size + p % block_size for p in range(cached, cached + n)]
        slots_b = [b[p // block_size] * block_size + p % block_size for p in range(cached, cached + n)]
        for layer in range(model.config.num_layers):
            for cache in (pool.k_cache(layer), pool.v_cache(layer)):
                flat = cache.reshape(-1, *cache.shape[2:])
                assert torch.equal(flat[slots_a], flat[slots_b])


@settings(max_examples=16, deadline=None)
@given(st.sampled_from(SHAPES), st.booleans(), st.sampled_from([1, 5, 16]), st.booleans(), st.integers(2, 3),
       st.integers(0, 2**31))
def test_decode_rows_split_between_the_threads_are_each_the_row_alone(
        heads_kv_d: tuple[int, int, int], bias: bool, block_size: int, repacked: bool, threads: int, seed: int) -> None:
    """A step of decode rows alone, from ``SPLIT_ROWS_MIN`` rows on, runs split between the threads
    (each its rows through every layer alone, 2 or 3 threads: uneven parts too): each row's hidden
    state and the K/V it writes are bit for bit those of the row decoded alone (one row: no split)."""
    heads, kv_heads, head_dim = heads_kv_d
    gtypes = (GgmlType.Q4_1, GgmlType.Q4_0) if repacked else (GgmlType.Q4_1, GgmlType.Q8_0)
    model = _model(heads, kv_heads, head_dim, bias, False, seed % 1000, gtypes)
    rng = random.Random(seed)
    rows = rng.randint(ggml_kernels.SPLIT_ROWS_MIN, min(model.whole_layers_max_rows(), 40))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert ggml_kernels.split_rows_min() <= rows
        _assert_step_is_its_rows_one_by_one(model, [(rng.randint(0, 120), 1) for _ in range(rows)], block_size, rng)
    finally:
        torch.set_num_threads(before)


def test_the_split_threshold_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_SPLIT_ROWS", raising=False)
    assert ggml_kernels.split_rows_min() == ggml_kernels.SPLIT_ROWS_MIN
    monkeypatch.setenv("TANDEM_SPLIT_ROWS", "9")
    assert ggml_kernels.split_rows_min() == 9
    monkeypatch.setenv("TANDEM_SPLIT_ROWS", "0")  # never
    assert ggml_kernels.split_rows_min() > 10**9
    monkeypatch.setenv("TANDEM_SPLIT_ROWS", "many")
    with pytest.raises(ValueError, match="TANDEM_SPLIT_ROWS"):
        ggml_kernels.split_rows_min()


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 4), st.integers(0, 40), st.integers(0, 2**31))
def test_a_long_prompt_runs_whole_up_to_the_row_cap_as_its_tokens_one_by_one(num_decode: int, cached: int,
                                                                            seed: int) -> None:
    """A prompt chunk of up to the row cap (``whole_layers_max_rows``: 1024 rows on Tandem's VNNI or AVX2
    kernel, 128 on ggml's gemm), beside decode rows, runs whole in C as its tokens decoded one by
    one, bit for bit: the kernel's many 8-row tiles finish each row as a row alone."""
    model = _model(4, 2, 32, False, False, seed % 1000, (GgmlType.Q4_1, GgmlType.Q4_0))
    assert model._whole_layers is not None and model._whole_layers.repacked
    cap = model.whole_layers_max_rows()
    if model.wide_format == WeightFormat.BF16:
        cap = min(cap, model.whole_layers_prompt_rows())
    rng = random.Random(seed)
    n = rng.randint(min(cap // 2, DECODE_LAYERS_X8_MAX_ROWS + 1), min(cap, 300)) - num_decode
    _assert_step_is_its_rows_one_by_one(model, [(rng.randint(0, 60), 1) for _ in range(num_decode)] + [(cached, n)],
                                        16, rng)
