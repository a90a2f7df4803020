"""A Llama-family decoder as plain functions over a weight dict (gpt-fast's shape, paged KV).

Covers Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm) and SmolLM2, with GQA and tied or separate embeddings. Numerics follow Hugging Face's
implementation (norms in fp32, rotate-half rope) so logits match it within fp32 rounding.

The model runs on a flattened batch: all new tokens of all sequences in one
``[num_tokens, hidden]`` tensor; attention is the only place that cares which token belongs
to which sequence (see ``attention.SeqSpan``).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, cast

import torch
import torch.nn.functional as F

from tandem.engine import ggml_kernels
from tandem.engine.allocator import tune_malloc
from tandem.engine.attention import AttentionBackend, TorchPagedAttention
from tandem.engine.config import ModelConfig, RopeScaling
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.quant import Linear, WeightFormat, effective_format, has_amx
from tandem.engine.smoothing import AbsMaxRecorder, row_divisor, smoothing_factors

# auto: prompt rows of an fp32 model attend in bf16 where its wide copy is bf16; model: in its dtype
# (``prompt_attention_dtype``).
PROMPT_ATTENTION_ENV = "TANDEM_PROMPT_ATTENTION"

# Most decode rows a step of the ggml format runs whole in C (``LlamaModel.decode_layers``); more
# run op by op, their projections on fbgemm's fp16 (``quant.GGML_MAX_ROWS``). Measured on SmolLM2,
# contexts around 128, both paths alternated (bench/cpu_kernels.py, median of 40 pairs): whole
# layers 1.60x / 1.49x / 1.33x / 1.33x / 1.02x faster at 1 / 2 / 3 / 4 / 6 rows, even at 8 (a
# scratch run: 1.08x at 6 rows, slower from 12; ggml's kernel takes one activation row at a time).
DECODE_LAYERS_MAX_ROWS = 6
# The same for layers repacked for ggml's gemm (``quant.GGML_X8_MAX_ROWS``), which unpacks each weight
# block once per 4 rows; prompt rows count (a hybrid step's chunk tokens run as rows of their own,
# ``ModelRunner.begin``). Against the op-by-op path (fbgemm's fp16 projections), the same step
# alternated in one process (bench/hybrid_rows.py, median of 10 pairs, two runs, 2026-11-30): decode
# rows beside a prompt chunk 0.79-0.95x the time from 36 to 80 rows, a 64-token prompt 0.91 / 0.96x,
# decode steps of 48 / 64 rows 0.86-0.87x / 0.91-0.92x, 0.94-0.99x from 104 to 128 rows. The cap
# was 32 until then (decode steps alone, 2026-11-27: 1.22x / 1.04x / 1.00x faster at 16 / 32 / 64
# rows), which sent every hybrid step of eight streams and a 27-token chunk to fbgemm's fp16, decode
# rows included.
DECODE_LAYERS_X8_MAX_ROWS = 128
# Where the ggml format's wide copy is oneDNN's bf16 (a CPU with AMX or AVX512-BF16,
# ``quant.ggml_wide_format``), a step with more prompt tokens than this runs op by op on it instead.
# SmolLM2 prompts alone, whole engine, medians of 3 (an AVX-512 + AMX host, 2026-12-01): 2 threads,
# whole in C / bf16 op by op 462 / 399 tok/s at 16 tokens, 546 / 478 at 24, 539 / 528 at 32, 551 /
# 1177 at 64, 522 / 1469 at 128; one thread 315 / 355, 294 / 446, 341 / 557 at 16 / 24 / 32, 330 /
# 1082 at 128. Decode rows alone stay whole in C: 352 / 302 tok/s at 16 rows, 390 / 377 at 32 (2
# threads). On AVX512-BF16 without AMX (an AMD EPYC, 2026-12-02; bench/hybrid_rows.py, medians of 6
# pairs) the gap is smaller: op by op / whole in C 0.83x for a 128-token prompt, 0.94x at 64, 0.87-0.95x
# for 8-16 decode rows beside a 48-64-token chunk, 0.98-1.01x at 24-32 prompt tokens.
WHOLE_LAYERS_BF16_PROMPT_ROWS = 32
# The same where the layers run on Tandem's AVX512-VNNI kernel (``ggml_kernels.Kernels.x8_vnni``)
# and the CPU has no AMX tiles (there oneDNN's bf16 prompts run 2x faster from 64 tokens, above):
# the row cap below. History: with the kernel's first version it was 128 (an AMD EPYC with
# AVX512-BF16 and VNNI, 2026-12-06; bench/hybrid_rows.py --base-cap 128 --cap 128 --base-prompt-cap
# 32 --prompt-cap 128, docs/results/hybrid-vnni-prompt-cap-1206.json: whole in C / op by op 0.81x
# for a 64-token prompt, 0.85x at 128, 0.76-0.87x for 8-16 decode rows beside a 48-96-token chunk).
WHOLE_LAYERS_VNNI_PROMPT_ROWS = 1024
# With Tandem's VNNI kernel (no AMX tiles) a step of up to this many rows, decode rows and prompt
# tokens together, runs whole in C, and the prompt cap above is the same: once the kernel's tiles
# added the Q4_1 offsets themselves (2026-12-06), whole in C / op by op on the bf16 copy, paired in
# one process on the same EPYC: 8 and 16 prompts of 49 tokens in one step (a closed loop's wave)
# 0.81x / 0.83x, one prompt of 256 / 512 tokens 0.83x / 0.87x, four of 256 0.95x, 8-16 decode rows
# beside a 128-512-token chunk 0.76-0.88x (bench/hybrid_rows.py --base-cap 128 --cap 1024
# --base-prompt-cap 128 --prompt-cap 1024); one prompt of 1024 / 2048 tokens 1.05x / 1.17x (its
# attention, quadratic in C, outgrows the bf16 SDPA), so a 1024-row cap. The same cap on Tandem's
# AVX2 kernel (``Kernels.x8_avx2``; the wide copy fbgemm's fp16 there): on 2 AVX2 cores, paired in one
# process (bench/hybrid_rows.py --base-cap 128 --cap 1024 --pairs 4, 2026-12-07,
# docs/results/hybrid-avx2-1024-1207.json) whole in C / op by op 0.88x for a 256-token prompt,
# 0.77-0.92x for 8-16 decode rows beside a 128-512-token chunk.
WHOLE_LAYERS_VNNI_MAX_ROWS = 1024


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2], with llama3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryCache:
    """cos/sin tables for every position up to the context length, computed once.

    ``sin_signed`` folds rotate-half's sign into the table (``-sin`` on the first half), so
    rope is ``x * cos + roll(x, d/2) * sin_signed``: three ops instead of a slice-negate-concat.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))  # [max_pos, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, d]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        half = config.head_dim // 2
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) rows of ``positions``, [num_tokens, 1, d] each (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, d]; cos/sin_signed [num_tokens, 1, d] from ``RotaryCache.lookup``.

    Equals Hugging Face's ``x * cos + rotate_half(x) * sin`` exactly: rotate_half(x) is
    roll(x, d/2) with the first half negated, and the negation sits in ``sin_signed``.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def prompt_attention_dtype(wide_format: WeightFormat, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype an fp32 model's prompts with nothing cached attend in on the torch backend
    (``TorchPagedAttention.prompt_dtype``, from ``attention.PROMPT_LOW_MIN_TOKENS`` tokens): bf16
    where the projections' wide copy is bf16 (the ggml format on a CPU with native bf16 matmuls,
    where prompt rows are rounded to bf16 at every projection already), so that SDPA runs on the
    same units: on an AMX Xeon it took 2.2 ms for a 1024-token prompt's layer against 5.9 ms in
    fp32, where it was 42 % of the prefill; prefills of 320-1984 tokens 1.14-1.43x faster at
    fp32 attention's perplexity (``bench/prompt_attention.py``). None: in the model's dtype.
    ``TANDEM_PROMPT_ATTENTION=model`` keeps the model's dtype everywhere."""
    choice = os.environ.get(PROMPT_ATTENTION_ENV, "auto")
    if choice not in ("auto", "model"):
        raise ValueError(f"{PROMPT_ATTENTION_ENV}={choice!r}: choose auto or model")
    if choice == "model" or dtype != torch.float32 or wide_format != WeightFormat.BF16:
        return None
    return torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        kernels = ggml_kernels.own_kernels()
        if kernels is not None:  # one C call: torch's runs several operators (30x slower at 512 rows)
            return kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # the weight folded into the norm's call
    # Normalise in fp32 and scale in the weight dtype, as Hugging Face does.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


class LlamaModel:
    """Weights + config; ``embed`` / ``layer`` / ``logits`` are the three stages of a forward."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        attention: AttentionBackend,
        weight_format: WeightFormat = WeightFormat.FP32,
        act_absmax: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``weight_format`` is how the linear layers run (see ``tandem.engine.quant``); a
        derived format is a private copy built here from ``weights``, which stay untouched.
        ``act_absmax`` (``activation_absmax``'s measurement) smooths the int8 format's layers
        (``tandem.engine.smoothing``); without it int8 runs unsmoothed."""
        self.config = config
        self.weights = weights
        self.attention = attention
        self.dtype = weights["embed_tokens"].dtype
        self.device = weights["embed_tokens"].device  # every weight and the pool live there
        if self.device.type == "cpu":
            tune_malloc()  # a prompt step's activations, freed and faulted in again layer after layer
        self.rotary = RotaryCache(config, self.dtype, self.device)
        if effective_format(weight_format, self.dtype, self.device) != WeightFormat.INT8:
            act_absmax = None
        self.smoothed = act_absmax is not None
        lm_head = weights["embed_tokens"] if config.tie_word_embeddings else weights["lm_head"]
        self.final_norm = weights["norm"]
        smooth = None
        if act_absmax is not None:
            smooth = smoothing_factors(act_absmax["lm_head"], lm_head)
            self.final_norm = (self.final_norm.float() / smooth).to(self.dtype)
        # Per-layer weights, looked up once rather than by string on every call; a derived
        # format's private copies are built on this process's compute threads.
        built = _on_threads([functools.partial(Linear, lm_head, None, weight_format, smooth, head=True)] + [
            functools.partial(_LayerWeights, weights, i, weight_format, config, act_absmax)
            for i in range(config.num_layers)], self.device)
        self.lm_head = cast(Linear, built[0])
        self._layers = cast(list[_LayerWeights], built[1:])
        self.weight_format = self.lm_head.format
        self._whole_layers = self._c_decode_layers()
        # how the projections run the calls ggml's kernels do not take (quant.ggml_wide_format)
        self.wide_format = self._layers[0].qkv_proj.wide_format if self._layers else self.lm_head.wide_format
        if isinstance(attention, TorchPagedAttention):
            attention.prompt_dtype = prompt_attention_dtype(self.wide_format, self.dtype)

    def _c_decode_layers(self) -> ggml_kernels.DecodeLayers | None:
        """The ggml format's layers for ``decode_layers`` (one C call per decode step), when every
        projection has ggml blocks and the layer is one the C code knows (no q/k norms)."""
        kernels = ggml_kernels.load()
        if self.weight_format != WeightFormat.GGML or kernels is None:
            return None
        layers = []
        for w in self._layers:
            qkv, o, gate_up, down = (lin.ggml_projection for lin in (w.qkv_proj, w.o_proj, w.gate_up_proj,
                                                                      w.down_proj))
            if qkv is None or o is None or gate_up is None or down is None or w.q_norm is not None:
                return None
            layers.append(ggml_kernels.LayerBlocks(w.input_norm.contiguous(), w.post_attn_norm.contiguous(),
                                                   w.qkv_proj.bias, qkv, o, gate_up, down))
        c = self.config
        return ggml_kernels.DecodeLayers(kernels, layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                         c.intermediate_size, c.rms_norm_eps)

    def decode_layers(self, start: int, stop: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attn_meta: object, pool: KVPool, independent: bool = False) -> bool:
        """Layers [start, stop) of a step of decode rows alone run whole in C, ``hidden`` updated in
        place, where they can: the ggml format, at most ``DECODE_LAYERS_MAX_ROWS`` rows
        (``whole_layers_max_rows``), attention
        planned on Tandem's C kernel (an fp32, fp16 or bf16 pool on the CPU), not turned off
        (``ggml_kernels.whole_layers_on``). False: the caller runs them op by op. ``independent``:
        every row a sequence of its own (``DecodeLayers.run``)."""
        fused = self._whole_layers
        if fused is None or not self.whole_layer_rows(hidden.shape[0], pool):
            return False
        tables = self.attention.decode_tables(attn_meta)
        if tables is None:
            return False
        fused.run(start, stop, hidden, cos, sin, tables[0], pool, tables[1], independent)
        return True

    def whole_layer_rows(self, num_rows: int, pool: KVPool, prompt_rows: int = 0) -> bool:
        """Whether a step of ``num_rows`` rows over ``pool``, ``prompt_rows`` of them prompt tokens,
        may run its layers whole in C (``decode_layers``): few enough rows (and prompt tokens, where
        the wide copy is bf16), and attention that plans them on the C kernel."""
        fused = self._whole_layers
        if fused is None or not ggml_kernels.whole_layers_on():
            return False
        if num_rows > self.whole_layers_max_rows():
            return False
        if self.wide_format == WeightFormat.BF16 and prompt_rows > self.whole_layers_prompt_rows():
            return False
        return self.attention.decodes_in_c(pool)

    def whole_layers_max_rows(self) -> int:
        """The most rows a step may run whole in C: ``DECODE_LAYERS_MAX_ROWS`` on ggml's plain rows,
        ``DECODE_LAYERS_X8_MAX_ROWS`` on layers repacked for ggml's gemm, ``WHOLE_LAYERS_VNNI_MAX_ROWS``
        where they run Tandem's VNNI or AVX2 kernel without AMX tiles (read at every call, like
        ``whole_layers_prompt_rows``); 0 without C layers."""
        fused = self._whole_layers
        if fused is None:
            return 0
        if not fused.repacked:
            return DECODE_LAYERS_MAX_ROWS
        return WHOLE_LAYERS_VNNI_MAX_ROWS if self._own_kernel_without_amx() else DECODE_LAYERS_X8_MAX_ROWS

    def _own_kernel_without_amx(self) -> bool:
        """The C layers run a kernel of Tandem's (VNNI or AVX2) and no AMX tiles: the host the long
        caps are for."""
        fused = self._whole_layers
        return fused is not None and (fused.vnni or fused.avx2) and not has_amx()

    def _vnni_without_amx(self) -> bool:
        """The C layers run Tandem's VNNI kernel and no AMX tiles (the prompt cap's host)."""
        fused = self._whole_layers
        return fused is not None and fused.vnni and not has_amx()

    def whole_layers_prompt_rows(self) -> int:
        """The most prompt tokens a step may carry whole in C where the wide copy is bf16:
        ``WHOLE_LAYERS_VNNI_PROMPT_ROWS`` on Tandem's VNNI kernel without AMX tiles, else
        ``WHOLE_LAYERS_BF16_PROMPT_ROWS`` (read at every call, so a benchmark can set either)."""
        if self._vnni_without_amx():
            return WHOLE_LAYERS_VNNI_PROMPT_ROWS
        return WHOLE_LAYERS_BF16_PROMPT_ROWS

    @property
    def derived_weight_bytes(self) -> int:
        """Bytes of this process's private derived (packed / quantized) weights."""
        return self.lm_head.derived_bytes + sum(layer.derived_bytes for layer in self._layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weights["embed_tokens"])  # [num_tokens, hidden]

    def layer(
        self,
        index: int,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim], sign-folded (RotaryCache.sin_signed)
        attn_meta: object,
        pool: KVPool,
    ) -> torch.Tensor:
        q, k, v = self.pre_attention(index, hidden, cos, sin)
        attn = self.attention.forward(index, q, k, v, attn_meta, pool)  # [num_tokens, H, d]
        return self.post_attention(index, hidden, attn)

    def pre_attention(self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's work before attention: q [T, H, d], k and v [T, kvh, d] (rope applied).
        Dense and per row: what piecewise CUDA graphs capture (``tandem.cuda.piecewise``)."""
        c = self.config
        w = self._layers[index]
        num_tokens = hidden.shape[0]
        qkv = w.qkv_proj(rms_norm(hidden, w.input_norm, c.rms_norm_eps))  # [T, q_size + 2 * kv_size]
        v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
        if w.q_norm is None or w.k_norm is None:
            # q and k heads side by side take one rope: [T, num_heads + num_kv_heads, d]
            qk = apply_rope(qkv[:, : c.q_size + c.kv_size].view(num_tokens, -1, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        else:
            q = rms_norm(qkv[:, : c.q_size].view(num_tokens, c.num_heads, c.head_dim), w.q_norm, c.rms_norm_eps)
            k = rms_norm(qkv[:, c.q_size : c.q_size + c.kv_size].view(num_tokens, c.num_kv_heads, c.head_dim),
                         w.k_norm, c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def post_attention(self, index: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """A layer's work after attention (``attn`` [T, H, d]): output projection, residual, MLP."""
        c = self.config
        w = self._layers[index]
        hidden = hidden + w.o_proj(attn.reshape(hidden.shape[0], c.q_size))
        gate_up = w.gate_up_proj(rms_norm(hidden, w.post_attn_norm, c.rms_norm_eps))  # [T, 2 * intermediate]
        gate, up = gate_up.chunk(2, dim=-1)
        return hidden + w.down_proj(F.silu(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the given rows: [n, hidden] -> [n, vocab] in fp32."""
        x = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return self.lm_head(x).float()


# The linear layers whose input activations ``activation_absmax`` measures, per layer.
SMOOTHED_LINEARS = ("qkv_proj", "gate_up_proj", "down_proj")


def activation_absmax(model: LlamaModel, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Largest magnitude of each input channel of every smoothed linear layer (``"{i}.qkv_proj"``
    ... and ``"lm_head"``) over ``windows``, each run as one prompt on a private scratch pool.
    Wraps ``model``'s layers while it runs: pass a model of its own (fp32, unsmoothed)."""
    from tandem.engine.runner import ModelRunner, SeqInput  # the runner imports this module

    recorders: dict[str, AbsMaxRecorder] = {"lm_head": AbsMaxRecorder(model.lm_head)}
    for i, layer in enumerate(model._layers):
        for name in SMOOTHED_LINEARS:
            recorders[f"{i}.{name}"] = recorder = AbsMaxRecorder(getattr(layer, name))
            setattr(layer, name, recorder)
    model.lm_head = recorders["lm_head"]  # type: ignore[assignment]
    block_size = 16
    blocks = -(-max(len(w) for w in windows) // block_size)
    pool = KVPool.create(KVPoolSpec.for_model(model.config, blocks, block_size, model.dtype))
    runner = ModelRunner(model, pool)
    with torch.inference_mode():
        for ids in windows:
            state = runner.begin([SeqInput(ids, 0, list(range(blocks)))])
            state.logit_rows = torch.arange(len(ids))  # the LM head sees every position
            runner.run_layers(state)
            runner.finish(state)
    return {name: rec.absmax for name, rec in recorders.items() if rec.absmax is not None}


_T = TypeVar("_T")


def _on_threads(builds: Sequence[Callable[[], _T]], device: torch.device) -> list[_T]:
    """``builds`` called on as many threads as this process computes with (torch's intra-op
    threads; one on a GPU, whose weights derive nothing): each builds a layer's private copies
    (ggml blocks, packed or quantized weights) in C and torch calls that release the GIL, so on
    2 cores SmolLM2-135M's ggml copies took 0.69 s against 1.06-1.18 s one layer after another,
    its fp16 copies 0.81-0.86 s against 1.56-1.72 s (a decode service's start and restart)."""
    workers = torch.get_num_threads() if device.type == "cpu" else 1
    if workers <= 1 or len(builds) <= 1:
        return [build() for build in builds]
    with ThreadPoolExecutor(workers, thread_name_prefix="derive-weights") as pool:
        return list(pool.map(lambda build: build(), builds))


class _LayerWeights:
    def __init__(self, w: dict[str, torch.Tensor], i: int, fmt: WeightFormat, config: ModelConfig,
                 act_absmax: dict[str, torch.Tensor] | None = None) -> None:
        self.input_norm = w[f"{i}.input_norm"]
        self.q_norm = w.get(f"{i}.q_norm")
        self.k_norm = w.get(f"{i}.k_norm")
        self.o_proj = Linear(w[f"{i}.o_proj"], None, fmt)
        self.post_attn_norm = w[f"{i}.post_attn_norm"]
        qkv, gate_up, down = w[f"{i}.qkv_proj"], w[f"{i}.gate_up_proj"], w[f"{i}.down_proj"]
        if act_absmax is None:
            self.qkv_proj = Linear(qkv, w.get(f"{i}.qkv_bias"), fmt)
            self.gate_up_proj = Linear(gate_up, None, fmt)
            self.down_proj = Linear(down, None, fmt)
            return
        # SmoothQuant: each division by s is folded into what feeds the layer (private copies).
        s_qkv = smoothing_factors(act_absmax[f"{i}.qkv_proj"], qkv)
        self.input_norm = (self.input_norm.float() / s_qkv).to(self.input_norm.dtype)
        self.qkv_proj = Linear(qkv, w.get(f"{i}.qkv_bias"), fmt, s_qkv)
        inter = config.intermediate_size
        s_down = smoothing_factors(act_absmax[f"{i}.down_proj"], down)
        up_rows = row_divisor(2 * inter, slice(inter, 2 * inter), s_down)  # down's input is silu(gate) * up
        s_gate_up = smoothing_factors(act_absmax[f"{i}.gate_up_proj"], gate_up.float() / up_rows[:, None])
        self.post_attn_norm = (self.post_attn_norm.float() / s_gate_up).to(self.post_attn_norm.dtype)
        self.gate_up_proj = Linear(gate_up, None, fmt, s_gate_up, up_rows)
        self.down_proj = Linear(down, None, fmt, s_down)

    @property
    def derived_bytes(self) -> int:
        return sum(lin.derived_bytes for lin in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj))
