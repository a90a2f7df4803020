"""Decode under CUDA graphs: one captured graph per (batch bucket, context bucket) and per
partition stream, with DuetServe's look-ahead (k greedy steps per launch, no CPU round trip).

A decode step launched op by op costs the CPU a few microseconds per kernel, hundreds per step:
at small batches that is longer than the GPU's work. A graph replays the whole step with one
launch. Graphs need fixed shapes and fixed buffers, so a step here reads everything from device
buffers the graph owns:

- ``tokens [B]`` (the step's input tokens), ``positions [B]`` (each one's position, i.e. its
  sequence's length before it) and ``tables [B, M]`` (block tables, padded);
- the step derives on the device what the eager path plans on the host: each row's pool slot
  (``tables[b, pos // bs] * bs + pos % bs``), its key mask (``key index <= pos``), its rope rows;
- attention either gathers the M blocks of every row and masks (``StaticDecodeAttention``, the
  ``torch`` choice: the same arithmetic as the eager backend's padded decode group), or reads the
  pool in place through flashinfer's paged decode kernel (``FlashInferGraphAttention``, the
  ``flashinfer`` choice): its CUDA-graph wrappers keep the CSR block table in fixed device
  buffers that the host re-plans before each replay, one wrapper per look-ahead step (step ``i``
  attends over ``i`` more tokens), so a graph's shape is its batch bucket alone and its slots come
  from the host too;
- with look-ahead k, each step's greedy token feeds the next: ``tokens`` takes the argmax and
  ``positions`` moves by one, k times inside the graph; the k tokens come back in one copy.

Rows beyond the real batch (bucket padding) compute on a scratch block that no request owns: its
K/V are garbage by design. The caller names that block (the agent reserves one) and gives each
real row blocks for ``positions + k`` tokens.

A graph captured on a partition's stream replays on that stream (a green context's SMs); one
decoder per partition shares one memory pool.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.cuda import CUDA_ATTENTION
from tandem.engine.attention import AttentionBackend, SeqSpan, gqa_sdpa
from tandem.engine.kv_pool import KVPool, PagedLayout, slot_ids
from tandem.engine.model import LlamaModel

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_FI_WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's split-K scratch, as its documentation advises


def flashinfer_unusable(pool: KVPool, dtype: torch.dtype) -> str | None:
    """Why flashinfer's paged decode cannot serve graph steps of a ``dtype`` model over
    ``pool``, or None when it can."""
    spec = pool.spec
    if spec.layout != "layer":
        return f"the pool is in {spec.layout!r} layout; flashinfer reads the 'layer' layout's contiguous K and V caches"
    if spec.dtype not in (torch.float16, torch.bfloat16) or spec.dtype != dtype:
        return f"flashinfer needs fp16 or bf16 K/V of the model's dtype; the pool is {spec.dtype}, the model {dtype}"
    try:
        import flashinfer  # noqa: F401  (lazy: CUDA-only dependency)
    except ImportError as exc:
        return f"flashinfer is not importable ({exc})"
    return None


def resolve_graph_attention(choice: str, pool: KVPool, dtype: torch.dtype,
                            option: str = "--cuda-attention") -> tuple[str, str]:
    """The attention graph steps run (``torch`` or ``flashinfer``) for ``--cuda-attention``
    ``choice``, and why: ``auto`` takes flashinfer where it can serve, ``flashinfer`` raises
    ValueError where it cannot. The eager steps' choice (``option``
    ``--cuda-eager-attention``) follows the same rule: flashinfer's paged prefill kernel needs
    what its paged decode kernel does."""
    if choice not in CUDA_ATTENTION:
        raise ValueError(f"unknown {option} {choice!r}; choose one of {CUDA_ATTENTION}")
    if choice == "torch":
        return "torch", "asked for"
    why = flashinfer_unusable(pool, dtype)
    if why is None:
        return "flashinfer", "flashinfer's paged kernels read the pool in place"
    if choice == "flashinfer":
        raise ValueError(f"{option} flashinfer: {why}")
    return "torch", why


@dataclass
class _StaticPlan:
    slots: torch.Tensor  # [B] int64
    tables: torch.Tensor  # [B, M] int64
    mask: torch.Tensor  # [B, 1, 1, M * block_size] bool


class StaticDecodeAttention(AttentionBackend):
    """Decode attention over fixed-shape device buffers (one query per row), capturable."""

    name = "static-decode"

    def plan(self, spans: Sequence[SeqSpan], pool: KVPool) -> Any:
        raise NotImplementedError("the static plan is built on the device by GraphDecoder")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, pool: KVPool) -> torch.Tensor:
        plan: _StaticPlan = meta
        pool.write(layer, plan.slots, k, v)
        rows, max_blocks = plan.tables.shape
        kvh, d = pool.spec.num_kv_heads, pool.spec.head_dim
        kv = pool.gather(layer, plan.tables.reshape(-1)).view(2, rows, max_blocks * pool.spec.block_size, kvh, d)
        kv = kv.transpose(2, 3).to(q.dtype)  # [2, B, kvh, S, d]
        out = gqa_sdpa(q.unsqueeze(2), kv[0], kv[1], plan.mask, 1.0 / math.sqrt(d))
        return out.squeeze(2)


@dataclass
class _FlashInferStep:
    slots: torch.Tensor  # [B] int64, the step's new K/V slots
    wrapper: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper, planned for the step's contexts


class FlashInferGraphAttention(AttentionBackend):
    """Decode attention of a captured step through flashinfer's paged decode kernel, which reads
    the pool in place (no gather, no padding to a context bucket); capturable, because the
    wrapper's block table lives in its fixed buffers."""

    name = "flashinfer-decode"

    def plan(self, spans: Sequence[SeqSpan], pool: KVPool) -> Any:
        raise NotImplementedError("graph steps are planned by GraphDecoder")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, pool: KVPool) -> torch.Tensor:
        step: _FlashInferStep = meta
        pool.write(layer, step.slots, k, v)
        out: torch.Tensor = step.wrapper.run(q, (pool.k_cache(layer), pool.v_cache(layer)))
        return out


class FlashInferPlans:
    """flashinfer's CUDA-graph decode wrappers, one per (batch bucket, look-ahead step), over one
    split-K workspace: shared by the decoders of every stream (their steps never overlap), each
    with index buffers for ``max_blocks`` blocks a row."""

    def __init__(self, pool: KVPool, num_qo_heads: int, max_blocks: int) -> None:
        import flashinfer  # lazy: CUDA-only dependency

        self._fi = flashinfer
        self.pool, self.num_qo_heads, self.max_blocks = pool, num_qo_heads, max_blocks
        self.workspace = torch.zeros(_FI_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.tensor.device)
        self._wrappers: dict[tuple[int, int], Any] = {}
        # A plan writes the wrapper's pinned host buffer, then copies it on the stream: the host
        # waits for the step that last read a wrapper's buffers before planning it again (unless
        # the plan is the one they hold: steps repeated back to back, as a profile queues them).
        self._last_use: dict[int, torch.cuda.Event] = {}
        self._planned: dict[int, list[PagedLayout]] = {}

    def wrapper(self, rows: int, step: int) -> Any:
        w = self._wrappers.get((rows, step))
        if w is None:
            dev = self.workspace.device
            w = self._wrappers[rows, step] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(rows + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(rows * self.max_blocks, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(rows, dtype=torch.int32, device=dev))
        return w

    def plan(self, rows: int, layouts: Sequence[PagedLayout]) -> list[Any]:
        """Plan the wrappers of bucket ``rows`` for look-ahead steps ``0..len(layouts)-1`` on
        the current stream; returns them."""
        held = self._planned.get(rows)
        if held is not None and len(held) == len(layouts) and all(
                torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
                and torch.equal(a.last_page_len, b.last_page_len) for a, b in zip(held, layouts)):
            return [self.wrapper(rows, step) for step in range(len(layouts))]
        last = self._last_use.pop(rows, None)
        if last is not None:
            last.synchronize()
        spec, planned = self.pool.spec, []
        for step, layout in enumerate(layouts):
            w = self.wrapper(rows, step)
            w.plan(layout.indptr, layout.indices, layout.last_page_len, self.num_qo_heads, spec.num_kv_heads,
                   spec.head_dim, spec.block_size, q_data_type=spec.dtype, kv_data_type=spec.dtype)
            planned.append(w)
        self._planned[rows] = list(layouts)
        return planned

    def used(self, rows: int, stream: torch.cuda.Stream) -> None:
        """Bucket ``rows``'s wrappers were just read by work launched on ``stream``."""
        event = torch.cuda.Event()
        event.record(stream)
        self._last_use[rows] = event


def step_layouts(seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], rows: int, lookahead: int,
                 block_size: int, scratch_block: int) -> tuple[list[PagedLayout], list[list[int]]]:
    """The host's plan of ``lookahead`` graph steps of ``rows`` rows for flashinfer: per step,
    the CSR block table of every row's context after that step's token is written, and that
    token's slot. Row ``i`` (of the real ``len(seq_lens)``) decodes its token at position
    ``seq_lens[i] - 1 + step``; padding rows decode at position ``step`` of the scratch block."""
    n = len(seq_lens)
    tables = [list(t) for t in block_tables] + [[scratch_block]] * (rows - n)
    layouts, slots = [], []
    for step in range(lookahead):
        lens = [length + step for length in seq_lens] + [step + 1] * (rows - n)
        layouts.append(PagedLayout.build(tables, lens, block_size))
        slots.append([slot_ids(table, length - 1, length, block_size)[0] for table, length in zip(tables, lens)])
    return layouts, slots


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    tables: torch.Tensor  # [B, M] (torch attention; flashinfer's graphs plan on the host)
    out_tokens: torch.Tensor  # [k, B]
    logits: torch.Tensor  # [B, vocab] of the last step
    slots: torch.Tensor | None = None  # [k, B] (flashinfer): each step's new K/V slots
    wrappers: list[Any] | None = None  # [k] (flashinfer): each step's planned decode wrapper


class GraphDecoder:
    """Greedy decode steps of ``model`` over ``pool``, replayed from CUDA graphs on ``stream``."""

    def __init__(self, model: LlamaModel, pool: KVPool, *, scratch_block: int, lookahead: int = 1,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, block_buckets: Sequence[int] = (64,),
                 stream: torch.cuda.Stream | None = None, mempool: Any = None, capture_all: bool = True,
                 attention: str = "torch", flashinfer_plans: FlashInferPlans | None = None) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if not 0 <= scratch_block < pool.spec.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the pool's {pool.spec.num_blocks} blocks")
        if lookahead < 1:
            raise ValueError("look-ahead must be at least one step")
        self.pool = pool
        self.lookahead = lookahead
        self.scratch_block = scratch_block
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.block_buckets = tuple(sorted(block_buckets))
        self.stream = stream if stream is not None else torch.cuda.Stream(model.device)
        self.mempool = mempool if mempool is not None else torch.cuda.graph_pool_handle()
        if attention not in ("torch", "flashinfer"):
            raise ValueError(f"graph attention must be 'torch' or 'flashinfer', got {attention!r}")
        self._model = copy.copy(model)  # shares the weights; only the attention differs
        self._fi: FlashInferPlans | None = None
        if attention == "flashinfer":
            why = flashinfer_unusable(pool, model.dtype)
            if why is not None:
                raise ValueError(f"flashinfer graph attention: {why}")
            if lookahead > pool.spec.block_size:  # padding rows look ahead within the scratch block
                raise ValueError(f"look-ahead {lookahead} exceeds the block size {pool.spec.block_size}")
            # No gather, no padded context: one "context bucket", the longest, sizes the index buffers.
            self.block_buckets = (self.block_buckets[-1],)
            self._fi = flashinfer_plans or FlashInferPlans(pool, model.config.num_heads, self.block_buckets[-1])
            self._model.attention = FlashInferGraphAttention()
        else:
            self._model.attention = StaticDecodeAttention()
        self.attention = attention
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_s = 0.0  # time spent capturing, all buckets so far
        if capture_all:  # else each bucket is captured on its first use
            for rows in self.batch_buckets:
                for blocks in self.block_buckets:
                    self.graph(rows, blocks)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def graph(self, rows: int, blocks: int) -> _Graph:
        """The graph of bucket (rows, blocks), captured now if it was not yet."""
        g = self._graphs.get((rows, blocks))
        if g is None:
            began = time.perf_counter()
            g = self._graphs[rows, blocks] = self._capture(rows, blocks)
            self.capture_s += time.perf_counter() - began
        return g

    def _step(self, g: _Graph) -> None:
        m, bs = self._model, self.pool.spec.block_size
        if g.wrappers is None:
            key_index = torch.arange(g.tables.shape[1] * bs, device=g.tokens.device)
        logits = g.logits
        for step in range(self.lookahead):
            pos = g.positions
            plan: _StaticPlan | _FlashInferStep
            if g.wrappers is not None and g.slots is not None:
                plan = _FlashInferStep(g.slots[step], g.wrappers[step])
            else:
                slots = g.tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs
                plan = _StaticPlan(slots, g.tables, (key_index[None, :] <= pos[:, None])[:, None, None, :])
            cos, sin = m.rotary.lookup(pos)
            hidden = m.embed(g.tokens)
            for layer in range(m.config.num_layers):
                hidden = m.layer(layer, hidden, cos, sin, plan, self.pool)
            logits = m.logits(hidden)
            nxt = logits.argmax(dim=-1)
            g.out_tokens[step].copy_(nxt)
            g.tokens.copy_(nxt)
            g.positions.add_(1)
        g.logits.copy_(logits)

    def _capture(self, rows: int, blocks: int) -> _Graph:
        dev = self._model.device
        g = _Graph(
            torch.cuda.CUDAGraph(),
            torch.zeros(rows, dtype=torch.int64, device=dev),
            torch.zeros(rows, dtype=torch.int64, device=dev),
            torch.full((rows, blocks if self._fi is None else 1), self.scratch_block, dtype=torch.int64, device=dev),
            torch.zeros(self.lookahead, rows, dtype=torch.int64, device=dev),
            torch.zeros(rows, self._model.config.vocab_size, dtype=torch.float32, device=dev),
        )
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            if self._fi is not None:  # capture and warm-up: every row a padding row
                self._plan_flashinfer(g, [], [])
            # Warm-up outside capture (allocator, cuBLAS handles, new kernels); scratch only. A
            # stream's first capture takes two, its later ones (new shapes) one.
            for _ in range(1 if self._graphs else 2):
                g.positions.zero_()
                self._step(g)
            g.positions.zero_()
            with torch.cuda.graph(g.graph, pool=self.mempool, stream=self.stream):
                self._step(g)
        self.stream.synchronize()
        return g

    def bucket(self, rows: int, blocks: int) -> tuple[int, int]:
        r = next((b for b in self.batch_buckets if b >= rows), None)
        m = next((b for b in self.block_buckets if b >= blocks), None)
        if r is None or m is None:
            raise ValueError(f"{rows} rows of {blocks} blocks exceed the captured buckets "
                             f"(rows {self.batch_buckets}, blocks {self.block_buckets})")
        return r, m

    def decode(self, tokens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``lookahead`` greedy steps from token ``i`` at position ``seq_lens[i] - 1``: returns
        the new tokens ``[k, n]`` and the last step's logits ``[n, vocab]`` (device tensors,
        ready once ``self.stream`` has run them)."""
        n, bs, k = len(tokens), self.pool.spec.block_size, self.lookahead
        if not n or not len(seq_lens) == len(block_tables) == n:
            raise ValueError("tokens, seq_lens and block_tables must be non-empty and of one length")
        for length, table in zip(seq_lens, block_tables, strict=True):
            if -(-(length - 1 + k) // bs) > len(table):
                raise ValueError(f"{len(table)} blocks cannot hold {length - 1 + k} tokens after {k} step(s)")
        rows, blocks = self.bucket(n, max(-(-(length - 1 + k) // bs) for length in seq_lens))
        g = self.graph(rows, blocks)
        scratch = self.scratch_block
        host_tokens = torch.tensor(list(tokens) + [0] * (rows - n), dtype=torch.int64)
        host_pos = torch.tensor([s - 1 for s in seq_lens] + [0] * (rows - n), dtype=torch.int64)
        with torch.cuda.stream(self.stream):
            g.tokens.copy_(host_tokens, non_blocking=True)
            g.positions.copy_(host_pos, non_blocking=True)
            if self._fi is not None:
                self._plan_flashinfer(g, seq_lens, block_tables)
            else:
                # Rows and table entries past the real ones point at the scratch block, position 0.
                g.tables.copy_(torch.tensor([list(t[:blocks]) + [scratch] * (blocks - len(t[:blocks]))
                                             for t in block_tables] + [[scratch] * blocks] * (rows - n),
                                            dtype=torch.int64), non_blocking=True)
            g.graph.replay()
            if self._fi is not None:
                self._fi.used(rows, self.stream)
            return g.out_tokens[:, :n].clone(), g.logits[:n].clone()

    def _plan_flashinfer(self, g: _Graph, seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
        """Plan graph ``g``'s flashinfer steps for these rows (the rest padding), on the current stream."""
        assert self._fi is not None
        rows = g.tokens.shape[0]
        layouts, slots = step_layouts(seq_lens, block_tables, rows, self.lookahead, self.pool.spec.block_size,
                                      self.scratch_block)
        # The wrappers' buffers and the slots are made within the capture's inference mode: they
        # are inference tensors, which only inference mode may update in place.
        with torch.inference_mode():
            g.wrappers = self._fi.plan(rows, layouts)
            if g.slots is None:
                g.slots = torch.zeros(self.lookahead, rows, dtype=torch.int64, device=g.tokens.device)
            g.slots.copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)


def context_buckets(max_blocks: int, first: int = 16, growth: float = 1.5) -> tuple[int, ...]:
    """Context buckets in blocks, from ``first`` up to ``max_blocks``, each at most ``growth``
    times the one below (rounded up to a multiple of ``first``): a step pads its rows to the
    bucket of its longest context, so the waste stays under ``growth``."""
    if max_blocks < 1 or first < 1 or growth <= 1:
        raise ValueError("context buckets need max_blocks >= 1, first >= 1 and growth > 1")
    buckets = []
    b = first
    while b < max_blocks:
        buckets.append(b)
        b = max(b + first, -(-int(b * growth) // first) * first)
    buckets.append(max_blocks)
    return tuple(buckets)


class ServiceGraphs:
    """decode_svc's pure decode steps replayed from CUDA graphs.

    One ``GraphDecoder`` per stream the steps are launched on (a green context's side of a split,
    or the whole device), all sharing one memory pool (steps never overlap: they run one after
    another on the service's torch thread); each (batch, context) bucket is captured on its first
    use on a stream, ``warm`` captures the common ones of the current stream up front. A step the
    graphs cannot serve returns None from ``logits`` and runs eagerly: a row computing more than
    one token (readmitted after a preemption), more rows or a longer context than the buckets.
    With ``attention="flashinfer"`` a stream's graphs are one per batch bucket (attention reads
    the pool in place, whatever the context) and share one set of flashinfer wrappers.
    """

    def __init__(self, model: LlamaModel, pool: KVPool, *, scratch_block: int, max_rows: int,
                 max_context: int, attention: str = "torch") -> None:
        bs = pool.spec.block_size
        self.model, self.pool, self.scratch_block = model, pool, scratch_block
        self.batch_buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_rows) + (
            min(max_rows, 256),)
        self.attention = attention
        self._fi: FlashInferPlans | None = None
        if attention == "flashinfer":
            self.block_buckets: tuple[int, ...] = (-(-max_context // bs),)
            self._fi = FlashInferPlans(pool, model.config.num_heads, self.block_buckets[-1])
        else:
            self.block_buckets = context_buckets(-(-max_context // bs))
        self.mempool = torch.cuda.graph_pool_handle()
        self._decoders: dict[int, GraphDecoder] = {}
        self.num_steps = 0

    def decoder(self) -> GraphDecoder:
        """The decoder of the current stream (created, capturing nothing, on first use). CUDA
        cannot capture on the default stream: there the decoder has a side stream of its own."""
        stream = torch.cuda.current_stream(self.model.device)
        decoder = self._decoders.get(stream.cuda_stream)
        if decoder is None:
            own = stream if stream != torch.cuda.default_stream(self.model.device) else None
            decoder = self._decoders[stream.cuda_stream] = GraphDecoder(
                self.model, self.pool, scratch_block=self.scratch_block, batch_buckets=self.batch_buckets,
                block_buckets=self.block_buckets, stream=own, mempool=self.mempool, capture_all=False,
                attention=self.attention, flashinfer_plans=self._fi)
        return decoder

    def warm(self, max_rows: int = 64, max_blocks: int = 512) -> None:
        """Capture the current stream's buckets up to the one that holds ``max_rows`` rows of
        ``max_blocks`` blocks (or the largest)."""
        decoder = self.decoder()
        top_rows, top_blocks = decoder.bucket(min(max_rows, self.batch_buckets[-1]),
                                              min(max_blocks, self.block_buckets[-1]))
        for rows in self.batch_buckets:
            for blocks in decoder.block_buckets:  # flashinfer's decoders have one, the longest
                if rows <= top_rows and blocks <= top_blocks:
                    decoder.graph(rows, blocks)

    @property
    def num_graphs(self) -> int:
        return sum(d.num_graphs for d in self._decoders.values())

    @property
    def capture_s(self) -> float:
        return sum(d.capture_s for d in self._decoders.values())

    def logits(self, tokens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
               ) -> torch.Tensor | None:
        """One decode step's logits ``[n, vocab]`` on the host (token ``i`` at position
        ``seq_lens[i] - 1``), or None when the step is not one a graph serves."""
        n, bs = len(tokens), self.pool.spec.block_size
        if not n or n > self.batch_buckets[-1] or max(-(-s // bs) for s in seq_lens) > self.block_buckets[-1]:
            return None
        current, decoder = torch.cuda.current_stream(self.model.device), self.decoder()
        if decoder.stream != current:  # a side stream: after what came before, and before what follows
            decoder.stream.wait_stream(current)
        _, logits = decoder.decode(tokens, seq_lens, block_tables)
        if decoder.stream != current:
            current.wait_stream(decoder.stream)
        self.num_steps += 1
        return logits.cpu()
