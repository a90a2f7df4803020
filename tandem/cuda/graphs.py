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
- attention gathers the M blocks of every row and masks (``StaticDecodeAttention``), the same
  arithmetic as the eager backend's padded decode group;
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

from tandem.engine.attention import AttentionBackend, SeqSpan, gqa_sdpa
from tandem.engine.kv_pool import KVPool
from tandem.engine.model import LlamaModel

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    tables: torch.Tensor  # [B, M]
    out_tokens: torch.Tensor  # [k, B]
    logits: torch.Tensor  # [B, vocab] of the last step


class GraphDecoder:
    """Greedy decode steps of ``model`` over ``pool``, replayed from CUDA graphs on ``stream``."""

    def __init__(self, model: LlamaModel, pool: KVPool, *, scratch_block: int, lookahead: int = 1,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, block_buckets: Sequence[int] = (64,),
                 stream: torch.cuda.Stream | None = None, mempool: Any = None, capture_all: bool = True) -> None:
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
        self._model = copy.copy(model)  # shares the weights; only the attention differs
        self._model.attention = StaticDecodeAttention()
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
        key_index = torch.arange(g.tables.shape[1] * bs, device=g.tokens.device)
        logits = g.logits
        for step in range(self.lookahead):
            pos = g.positions
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
            torch.full((rows, blocks), self.scratch_block, dtype=torch.int64, device=dev),
            torch.zeros(self.lookahead, rows, dtype=torch.int64, device=dev),
            torch.zeros(rows, self._model.config.vocab_size, dtype=torch.float32, device=dev),
        )
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(self.stream):
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
        # Rows and table entries past the real ones point at the scratch block, position 0.
        host_tables = torch.tensor([list(t[:blocks]) + [scratch] * (blocks - len(t[:blocks])) for t in block_tables]
                                   + [[scratch] * blocks] * (rows - n), dtype=torch.int64)
        host_tokens = torch.tensor(list(tokens) + [0] * (rows - n), dtype=torch.int64)
        host_pos = torch.tensor([s - 1 for s in seq_lens] + [0] * (rows - n), dtype=torch.int64)
        with torch.cuda.stream(self.stream):
            g.tokens.copy_(host_tokens, non_blocking=True)
            g.positions.copy_(host_pos, non_blocking=True)
            g.tables.copy_(host_tables, non_blocking=True)
            g.graph.replay()
            return g.out_tokens[:, :n].clone(), g.logits[:n].clone()


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
    """

    def __init__(self, model: LlamaModel, pool: KVPool, *, scratch_block: int, max_rows: int,
                 max_context: int) -> None:
        bs = pool.spec.block_size
        self.model, self.pool, self.scratch_block = model, pool, scratch_block
        self.batch_buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_rows) + (
            min(max_rows, 256),)
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
                block_buckets=self.block_buckets, stream=own, mempool=self.mempool, capture_all=False)
        return decoder

    def warm(self, max_rows: int = 64, max_blocks: int = 512) -> None:
        """Capture the current stream's buckets up to the one that holds ``max_rows`` rows of
        ``max_blocks`` blocks (or the largest)."""
        decoder = self.decoder()
        top_rows, top_blocks = decoder.bucket(min(max_rows, self.batch_buckets[-1]),
                                              min(max_blocks, self.block_buckets[-1]))
        for rows in self.batch_buckets:
            for blocks in self.block_buckets:
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
