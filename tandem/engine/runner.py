"""The execution API the services use: forward passes over the shared paged pool.

One batch mixes any sequences: a prompt (prefill), a chunk of one (chunked prefill), one
token each (decode), or all of these at once (hybrid). A pass can be run whole
(``forward``) or resumed layer group by layer group (``begin`` → ``run_layers`` … →
``finish``), which is how prefill yields the device to a partition change or a preempting
request between groups. The runner holds no request state: block ids and cached lengths come
in with every batch, so the same runner serves any process that maps the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.attention import SeqSpan, make_backend
from tandem.engine.config import ModelConfig
from tandem.engine.errors import InvalidRequestError, ModelLoadError
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.model import LlamaModel, activation_absmax
from tandem.engine.quant import WeightFormat, effective_format
from tandem.engine.smoothing import byte_windows, calibration_windows
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.weights import load_checkpoint

if TYPE_CHECKING:
    from tandem.cuda.piecewise import PiecewiseForward


@dataclass(frozen=True)
class SeqInput:
    """One sequence's work in a batch.

    ``token_ids`` are the new tokens to compute, at positions
    [num_cached_tokens, num_cached_tokens + len(token_ids)); ``block_ids`` must cover all of
    them. ``need_logits`` is False for a prefill chunk that is not the prompt's last.
    """

    token_ids: Sequence[int]
    num_cached_tokens: int
    block_ids: Sequence[int]
    need_logits: bool = True


@dataclass
class ForwardState:
    """A forward pass in progress; ``next_layer`` is the first layer not yet run."""

    hidden: torch.Tensor  # [num_tokens, hidden]
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor  # [num_tokens, 1, head_dim], sign-folded for rope
    attn_meta: Any
    logit_rows: torch.Tensor  # [num_seqs_with_logits] int64, last row of each such sequence
    next_layer: int = 0
    # every row a sequence of its own (no prompt rows): no row reads K/V another row writes
    independent_rows: bool = False


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool) -> None:
        cfg = model.config
        spec = pool.spec
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"KV pool shape (layers={spec.num_layers}, kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}) "
                f"does not fit the model ({cfg.num_layers}, {cfg.num_kv_heads}, {cfg.head_dim})"
            )
        self.model = model
        self.pool = pool
        self.config = cfg
        # Logits copied to the host by ``finish`` (a GPU runner whose caller samples on the CPU).
        self.host_logits = False
        # A CUDA runner's piecewise graphs (tandem.cuda.piecewise): ``forward`` runs the layers of
        # a batch of up to their largest bucket through them. None: op by op.
        self.piecewise: PiecewiseForward | None = None

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        pool: KVPool,
        dtype: torch.dtype = torch.float32,
        attention: str = "torch",
        weight_format: WeightFormat = WeightFormat.FP32,
    ) -> ModelRunner:
        config = ModelConfig.from_dir(model_dir)
        weights = load_checkpoint(model_dir, config, dtype)
        return cls(build_model(model_dir, config, weights, attention, weight_format), pool)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    # ---------------------------------------------------------------- layer-group API
    @torch.inference_mode()  # as forward's: a plan's buffers are of one kind whoever calls (attention_flashinfer)
    def begin(self, batch: Sequence[SeqInput]) -> ForwardState:
        """Validate the batch, embed its tokens and plan attention; runs no layer."""
        if not batch:
            raise InvalidRequestError("empty batch")
        block_size = self.pool.spec.block_size
        max_len = self.config.max_position_embeddings
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        logit_rows: list[int] = []
        for seq in batch:
            q_len = len(seq.token_ids)
            end = seq.num_cached_tokens + q_len
            if q_len == 0:
                raise InvalidRequestError("a sequence in the batch has no new tokens")
            if end > max_len:
                raise InvalidRequestError(
                    f"sequence of {end} tokens exceeds the model's context length of {max_len}"
                )
            if -(-end // block_size) > len(seq.block_ids):
                raise InvalidRequestError(
                    f"{len(seq.block_ids)} blocks cannot hold {end} tokens (block size {block_size})"
                )
            spans.append(SeqSpan(len(token_ids), q_len, seq.num_cached_tokens, seq.block_ids))
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.num_cached_tokens, end))
            if seq.need_logits:
                logit_rows.append(len(token_ids) - 1)
        if max(token_ids) >= self.config.vocab_size or min(token_ids) < 0:  # checked host-side: no device sync
            raise InvalidRequestError(f"token id out of range [0, {self.config.vocab_size})")
        prompt_rows = sum(s.q_len for s in spans if s.q_len > 1)
        if prompt_rows and self.model.whole_layer_rows(len(token_ids), self.pool, prompt_rows):
            # Prompt tokens few enough for the layers to run whole in C: each becomes a row of its
            # own that attends over its sequence up to itself, as a decode row does. That is causal
            # attention, the chunk's earlier K/V written in the same layer before any row reads.
            spans = [SeqSpan(s.q_start + i, 1, s.num_cached + i, s.block_ids) for s in spans for i in range(s.q_len)]
        device = self.model.device
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        cos, sin = self.model.rotary.lookup(torch.tensor(positions, dtype=torch.int64, device=device))
        return ForwardState(
            hidden=self.model.embed(ids),
            cos=cos,
            sin=sin,
            attn_meta=self.model.attention.plan(spans, self.pool),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=device),
            independent_rows=prompt_rows == 0,
        )

    @torch.inference_mode()
    def run_layers(self, state: ForwardState, end: int | None = None) -> None:
        """Run layers [state.next_layer, end); K/V of those layers land in the pool."""
        stop = self.num_layers if end is None else end
        if not state.next_layer <= stop <= self.num_layers:
            raise ValueError(f"cannot run layers [{state.next_layer}, {stop}) of {self.num_layers}")
        hidden = state.hidden
        if not self.model.decode_layers(state.next_layer, stop, hidden, state.cos, state.sin, state.attn_meta,
                                        self.pool, state.independent_rows):
            for index in range(state.next_layer, stop):
                hidden = self.model.layer(index, hidden, state.cos, state.sin, state.attn_meta, self.pool)
        state.hidden = hidden
        state.next_layer = stop

    @torch.inference_mode()
    def finish(self, state: ForwardState) -> torch.Tensor:
        """Logits [num_seqs_with_need_logits, vocab] (fp32) of each such sequence's last token."""
        if state.next_layer != self.num_layers:
            raise ValueError(f"forward pass stopped at layer {state.next_layer} of {self.num_layers}")
        logits = self.model.logits(state.hidden[state.logit_rows])
        return logits.cpu() if self.host_logits else logits

    # ---------------------------------------------------------------- whole passes
    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqInput]) -> torch.Tensor:
        state = self.begin(batch)
        pieces = self.piecewise
        if pieces is not None and pieces.ready(state.hidden.shape[0]):
            state.hidden = pieces.run(state.hidden, state.cos, state.sin, state.attn_meta)
            state.next_layer = self.num_layers
        else:
            self.run_layers(state)
        return self.finish(state)

    def prefill(self, batch: Sequence[SeqInput]) -> torch.Tensor:
        """Prompts (or their uncached remainder); same as ``forward``, named for readers."""
        return self.forward(batch)

    def decode(self, token_ids: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One decode step: token ``i`` sits at position ``seq_lens[i] - 1`` of sequence ``i``."""
        return self.forward(
            [
                SeqInput((tok,), seq_len - 1, blocks)
                for tok, seq_len, blocks in zip(token_ids, seq_lens, block_tables, strict=True)
            ]
        )


def build_model(model_dir: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor], attention: str,
                weight_format: WeightFormat) -> LlamaModel:
    """The model over ``weights`` in ``weight_format``. The int8 format is calibrated first:
    one fp32 pass over a fixed text measures what SmoothQuant needs (``tandem.engine.smoothing``;
    about a second for SmolLM2 on 2 cores)."""
    act_absmax = None
    if effective_format(weight_format, weights["embed_tokens"].dtype, weights["embed_tokens"].device) == WeightFormat.INT8:
        try:
            windows = calibration_windows(Tokenizer.from_dir(model_dir).encode)
        except ModelLoadError:  # no tokenizer (a test checkpoint): the text's bytes
            windows = byte_windows(config.vocab_size)
        act_absmax = activation_absmax(LlamaModel(config, weights, make_backend("torch", config.num_heads)), windows)
    return LlamaModel(config, weights, make_backend(attention, config.num_heads), weight_format, act_absmax)


@dataclass(frozen=True)
class PromptStepTiming:
    """A prompt of ``prompt_tokens`` computed beside one decode step of ``decode_context_lens``:
    the step less that decode step alone (``prompt_s``), and the decode step (``decode_s``)."""

    prompt_tokens: int
    decode_context_lens: tuple[int, ...]
    prompt_s: float
    decode_s: float


# The prompt sizes decode_svc times at start-up (see ``warm_up``).
PROMPT_TIMING_SIZES = (32, 256)


def warm_up(model: LlamaModel, prompt_tokens: int = 64, decode_batches: Sequence[int] = (1, 8),
            time_prompts: Sequence[int] = (), repeats: int = 3) -> list[PromptStepTiming]:
    """Run a prompt and a few decode steps on a private scratch pool, so that the first real
    request does not pay for the kernels' one-time set-up (oneDNN primitives, allocator
    growth: seconds on a small CPU). The shared pool is never written.

    Then time a prompt of each size in ``time_prompts`` beside one step of the warmed sequence
    (``prompt_tokens`` of context): what the gpu_agent fits the shape of a hybrid step's prompt
    part on (its fixed cost against its cost per token), before any live step. Each shape runs
    ``repeats`` times and the fastest counts (a new row count's first run builds its kernels).
    Sizes the model cannot take are left out. About a second for SmolLM2-135M's defaults on two
    cores."""
    cfg = model.config
    block_size = 16
    prompt_tokens = min(prompt_tokens, cfg.max_position_embeddings - 1)
    blocks_per_seq = -(-(prompt_tokens + 1) // block_size)
    num_seqs = max(decode_batches, default=1)
    sizes = [n for n in time_prompts if 0 < n < cfg.max_position_embeddings]
    blocks_prompt = -(-max(sizes, default=0) // block_size)
    pool = KVPool.create(KVPoolSpec.for_model(cfg, blocks_per_seq * num_seqs + blocks_prompt, block_size, model.dtype),
                         model.device)
    runner = ModelRunner(model, pool)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    ids = [1 + i % (cfg.vocab_size - 1) for i in range(prompt_tokens)]
    runner.forward([SeqInput(ids, 0, tables[0])])
    if model.device.type == "cuda":
        # A GPU's first GEMM of each new shape pays cuBLAS's set-up (a 2048-token prompt's first
        # step took 1.06 s on an H100 where it runs in 63 ms): run a 2048-token prompt too, on a
        # scratch pool of its own.
        long_ids = [1 + i % (cfg.vocab_size - 1) for i in range(min(2048, cfg.max_position_embeddings - 1))]
        long_pool = KVPool.create(KVPoolSpec.for_model(cfg, -(-len(long_ids) // block_size), block_size, model.dtype),
                                  model.device)
        ModelRunner(model, long_pool).forward([SeqInput(long_ids, 0, list(range(long_pool.spec.num_blocks)))])
        torch.cuda.synchronize(model.device)
    for batch in decode_batches:
        runner.forward([SeqInput((1,), prompt_tokens, tables[i]) for i in range(batch)])
    if not sizes:
        return []

    import time

    def fastest(batch: list[SeqInput]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(batch)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            times.append(time.perf_counter() - start)
        return min(times)

    decode = SeqInput((1,), prompt_tokens, tables[0])
    decode_s = fastest([decode])
    prompt_blocks = list(range(blocks_per_seq * num_seqs, blocks_per_seq * num_seqs + blocks_prompt))
    timings = []
    for n in sizes:
        step_s = fastest([decode, SeqInput([1 + i % (cfg.vocab_size - 1) for i in range(n)], 0, prompt_blocks)])
        timings.append(PromptStepTiming(n, (prompt_tokens + 1,), max(step_s - decode_s, 1e-6), decode_s))
    return timings


def position_logits(runner: ModelRunner, ids: Sequence[int], chunk: int | None = None) -> torch.Tensor:
    """Logits of every position of one prompt, [len(ids), vocab], for evaluation (perplexity,
    top-1 agreement), in blocks ``0..n`` of the runner's pool. With ``chunk`` the prompt is
    computed that many tokens at a time, so each chunk attends to the earlier K/V read back from
    the pool, as decode does (one whole prefill attends to its own K/V rounded as the pool
    stores them: the same up to fp32's last bits)."""
    ids = list(ids)
    blocks = list(range(-(-len(ids) // runner.pool.spec.block_size)))
    step = chunk or len(ids)
    out = []
    for start in range(0, len(ids), step):
        part = ids[start : start + step]
        state = runner.begin([SeqInput(part, start, blocks)])
        state.logit_rows = torch.arange(len(part))
        runner.run_layers(state)
        out.append(runner.finish(state))
    return torch.cat(out)
