"""Steps with prompt tokens under piecewise CUDA graphs: each layer's dense work replayed from a
graph, attention run eagerly between the graphs (vLLM's piecewise graphs).

A step that carries prompt tokens (a hybrid step of ``chunked``: decode rows plus a chunk; a
readmitted request recomputing its tokens) cannot be one CUDA graph: its attention depends on
how the tokens split into sequences and on their contexts. Run op by op it costs the host some
2,000 launches a step for an 8B model: on the H100 a live hybrid step took 75 ms of host time
for 14 ms of GPU work. Everything but attention is per row, so for each token bucket ``T``:

- graph 0 runs layer 0's ``pre_attention`` (norm, QKV projection, rope) on static ``hidden``
  [T, hidden] and ``cos``/``sin`` [T, 1, d], leaving q, k, v in its static outputs;
- graph ``i`` (1..L) runs layer ``i-1``'s ``post_attention`` (output projection, residual, MLP)
  on the static attention buffer [T, H, d], then layer ``i``'s ``pre_attention`` (none after the
  last layer);
- between graphs the model's attention backend runs eagerly on the real rows (it writes their
  K/V into the pool and attends), and its output is copied into the attention buffer.

Rows past the real ones (bucket padding) compute on zeros and are never read. One set of graphs
per stream the steps run on, captured on first use (``warm`` captures a stream's up front); a
step of more tokens than the largest bucket runs eagerly. ``capture=False`` runs the same pieces
without graphs, so their plumbing is checked on a CPU (tests/unit/test_cuda_without_gpu.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.engine.kv_pool import KVPool
from tandem.engine.model import LlamaModel

log = logging.getLogger("tandem.cuda.piecewise")
DEFAULT_TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class _Bucket:
    tokens: int
    hidden: torch.Tensor  # [T, hidden]: the embedded tokens, graph 0's input
    cos: torch.Tensor  # [T, 1, d]
    sin: torch.Tensor  # [T, 1, d]
    attn: torch.Tensor  # [T, H, d]: each layer's attention output, graph i+1's input
    pieces: list[Callable[[], None]] = field(default_factory=list)  # L + 1 replays (or eager runs)
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer
    out: torch.Tensor | None = None  # [T, hidden] after the last layer
    graphs: list[Any] = field(default_factory=list)  # keeps the CUDA graphs alive


class PiecewiseForward:
    """The layers of ``model`` over ``pool`` for one batch of at most ``buckets[-1]`` tokens."""

    def __init__(self, model: LlamaModel, pool: KVPool, *, buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS,
                 capture: bool = True) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError("piecewise CUDA graphs need the model on a CUDA device")
        self.model, self.pool, self.capture = model, pool, capture
        self.buckets = tuple(sorted(buckets))
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self._sets: dict[int, dict[int, _Bucket]] = {}  # stream handle -> token bucket -> pieces
        self._side: dict[int, torch.cuda.Stream] = {}  # capture streams for the default stream
        self.capture_s = 0.0
        self.num_steps = 0
        self.failed = False

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def num_graphs(self) -> int:
        return sum(len(b.graphs) for s in self._sets.values() for b in s.values())

    def _stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.model.device) if self.capture else None

    def bucket(self, num_tokens: int) -> _Bucket:
        """The pieces of the smallest bucket that holds ``num_tokens`` on the current stream."""
        tokens = next((b for b in self.buckets if b >= num_tokens), None)
        if tokens is None:
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket ({self.buckets[-1]})")
        stream = self._stream()
        key = stream.cuda_stream if stream is not None else 0
        made = self._sets.setdefault(key, {})
        if tokens not in made:
            began = time.perf_counter()
            made[tokens] = self._make(tokens, stream)
            self.capture_s += time.perf_counter() - began
        return made[tokens]

    def ready(self, num_tokens: int) -> bool:
        """Whether ``run`` takes a batch of ``num_tokens`` now (its bucket made, on first use
        here). A bucket that fails to capture is logged and turns the pieces off for good: the
        caller runs its layers op by op."""
        if self.failed or num_tokens > self.max_tokens:
            return False
        try:
            self.bucket(num_tokens)
        except Exception:
            self.failed = True
            log.exception("capturing piecewise CUDA graphs for %d tokens failed; running steps op by op", num_tokens)
            return False
        return True

    def warm(self) -> None:
        """Make every bucket's pieces on the current stream."""
        for tokens in self.buckets:
            self.bucket(tokens)

    def _make(self, tokens: int, stream: torch.cuda.Stream | None) -> _Bucket:
        m, c = self.model, self.model.config
        dev = m.device
        with torch.inference_mode():  # the forward passes that fill them run in inference mode
            hidden, cos, sin, attn = (torch.zeros(*shape, dtype=m.dtype, device=dev) for shape in (
                (tokens, c.hidden_size), (tokens, 1, c.head_dim), (tokens, 1, c.head_dim),
                (tokens, c.num_heads, c.head_dim)))
        b = _Bucket(tokens, hidden, cos, sin, attn)
        num_layers = c.num_layers

        def piece(i: int, hidden: torch.Tensor) -> torch.Tensor:
            """Graph i: layer i-1's post-attention (i > 0), then layer i's pre-attention (i < L)."""
            if i > 0:
                hidden = m.post_attention(i - 1, hidden, b.attn)
            if i < num_layers:
                qkv = m.pre_attention(i, hidden, b.cos, b.sin)
                if len(b.qkv) <= i:
                    b.qkv.append(qkv)
                else:
                    b.qkv[i] = qkv
            return hidden

        if not self.capture:
            def eager(i: int) -> Callable[[], None]:
                def run() -> None:
                    hidden = piece(i, b.hidden if i == 0 else b.out)  # type: ignore[arg-type]
                    b.out = hidden
                return run
            b.pieces = [eager(i) for i in range(num_layers + 1)]
            return b
        assert stream is not None and self.mempool is not None
        capture_on = stream
        if stream == torch.cuda.default_stream(dev):  # CUDA cannot capture on the default stream
            capture_on = self._side.setdefault(stream.cuda_stream, torch.cuda.Stream(dev))
        capture_on.wait_stream(stream)
        with torch.inference_mode(), torch.cuda.stream(capture_on):
            hidden = b.hidden
            for i in range(num_layers + 1):  # a warm-up outside capture (cuBLAS workspaces, kernels)
                hidden = piece(i, hidden)
            b.qkv.clear()
            hidden = b.hidden
            for i in range(num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.mempool, stream=capture_on):
                    hidden = piece(i, hidden)
                b.graphs.append(graph)
            b.out = hidden
        stream.wait_stream(capture_on)
        b.pieces = [g.replay for g in b.graphs]
        return b

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_meta: Any) -> torch.Tensor:
        """The layers over ``hidden`` [n, hidden] (embedded tokens; ``cos``/``sin`` their rope
        rows; ``attn_meta`` the attention backend's plan of the batch): [n, hidden] after the last
        layer, K/V of every layer written into the pool."""
        n = hidden.shape[0]
        b = self.bucket(n)
        b.hidden[:n].copy_(hidden)
        b.hidden[n:].zero_()
        b.cos[:n].copy_(cos)
        b.sin[:n].copy_(sin)
        attention = self.model.attention
        b.pieces[0]()
        for i in range(self.model.config.num_layers):
            q, k, v = b.qkv[i]
            b.attn[:n].copy_(attention.forward(i, q[:n], k[:n], v[:n], attn_meta, self.pool))
            b.pieces[i + 1]()
        self.num_steps += 1
        assert b.out is not None
        return b.out[:n]
