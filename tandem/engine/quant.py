"""Weight formats of the linear layers: how a process turns the shared weights into the matmul
it runs.

The shared copy in ``/dev/shm`` is always the checkpoint's weights in the model dtype; a format
other than ``fp32`` is a *private* copy that each compute process derives from it at start, since
packed and quantized weights are opaque tensors (oneDNN's blocked layout, fbgemm's packed
matrices) that cannot live in a shared-memory file. ``derived_bytes`` says what that costs.

Which format is fastest and which keeps the model's accuracy is measured, not assumed
(``bench/quant.py``; results in ``docs/results/quant-cpu.json``): fbgemm's fp16 weights (fp32
activations and accumulation, any AVX2 CPU) halve the bytes of fp32 at fp32's perplexity, and
are ``auto``'s pick; bf16 weights through oneDNN (native on AVX512-BF16) are as fast but round
activations too. fbgemm's int8 halves the bytes again and is the fastest, but it quantizes the
activations as well, so it is lossy and never picked by ``auto``. fbgemm takes one activation
scale per call; here each row (token) gets its own (the row is divided by its largest magnitude
before the call and the output multiplied back), so one outlier token no longer flattens every
other row of a batch, and SmoothQuant's per-channel factors (``tandem.engine.smoothing``) move
the activations' outlier channels into the weights (perplexity on SmolLM2 from x2.7 to ~x1.04
of fp32's; ``bench/quant.py``).

``ggml`` runs llama.cpp's own kernels (``tandem.engine.ggml_kernels``) on the block-quantized
types a GGUF stores (Q4_1, Q4_0, Q8_0), for the layers whose shared weights such a type holds
exactly, i.e. a model imported from a GGUF of those types: the weights lose nothing, and each
activation row is quantized to 8 bits per 32 values as llama.cpp does. It reads a quarter of
fp16's bytes, so single-stream decode steps run ~1.6x faster here; ggml's vec_dot kernel takes
one activation row at a time, so calls of more than ``GGML_MAX_ROWS`` rows (batched decode,
prefill) run the fp16 copy it also keeps, except decode steps of up to
``model.DECODE_LAYERS_MAX_ROWS`` rows, whose layers run whole in C on ggml's kernels
(``LlamaModel.decode_layers``). On an AVX2 CPU, Q4_0 and Q4_1 layers of whole 8-row groups are
repacked at load for ggml's gemm (``Kernels.repack_x8``; Q4_1 exactly, its offsets added apart),
which unpacks a weight block once per 4 rows: calls of up to ``GGML_X8_MAX_ROWS`` rows and
steps of up to ``model.DECODE_LAYERS_X8_MAX_ROWS`` rows (decode rows and prompt tokens together:
hybrid steps, prompt chunks) run on it (``TANDEM_GGML_REPACK=off`` keeps the plain rows); those
calls run a kernel of Tandem's over the same blocks instead of ggml's gemm (``Kernels.x8_avx2``,
or ``Kernels.x8_vnni`` with AVX512-VNNI), and then steps of up to
``model.WHOLE_LAYERS_VNNI_MAX_ROWS`` rows run whole in C. The
model's lm_head (a GGUF's Q8_0 token embedding, tied: the largest single weight of a small model)
is repacked on an AVX512-VNNI CPU for a kernel of Tandem's (``Kernels.repack_q8_x16``) that runs
calls of up to ``GGML_Q8_X16_MAX_ROWS`` rows, each row as it would run alone: 16-row decode steps
of SmolLM2 1.25x faster than on fbgemm's fp16 copy, which reads twice the bytes (bench/q8_head.py).
On an AVX2 CPU without VNNI, likewise for another of Tandem's kernels (``Kernels.repack_q8_x8``,
``GGML_Q8_X8_MAX_ROWS``), where fbgemm's fp16 ran at half its FMA peak.
Greedy outputs therefore depend on how requests were batched, and ``auto`` never picks it.

The ggml format's calls of more rows than its kernels take (prompts, large batches) run a second,
private copy of the weights, its *wide* copy (``ggml_wide_format``): fbgemm's fp16, or oneDNN's
bf16 on a CPU with a bf16 dot product (``has_bf16_dot``: AMX tiles or AVX512-BF16). On an AMX host
its tile matmuls ran SmolLM2's projections 3.6-3.9x faster than fbgemm's fp16 at 64-512 rows (whole
engine, prompts of 48-512 tokens: 1.25-3.3x); on an AVX512-BF16 host without AMX (an AMD EPYC,
2026-12-02) 1.8-2.2x at 128-512 rows (prompts of 512 tokens, or 16 of 128 in one step: 1.4-1.5x).
bench/quant.py measures the accuracy: it rounds those calls' activations to bf16. Both copies take
2 bytes a weight.

oneDNN compiles a primitive per row count, so its calls (bf16, fp32-packed, a bf16 wide copy) of
more than ``ONEDNN_EXACT_ROWS`` rows run padded to a few sizes (``onednn_rows``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings

import torch
import torch.nn.functional as F

from tandem.engine import ggml_kernels
from tandem.engine.weight_format import WeightFormat

log = logging.getLogger(__name__)

# Largest number of rows the ggml format runs through ggml's kernels; larger calls (batched
# decode, prefill) run fbgemm's fp16, faster there on AVX2. Measured on SmolLM2, decode steps at
# context 128, both paths interleaved (median of 6): 1.58x / 1.24x / 1.26x faster at 1 / 2 / 3
# rows, even at 4, slower from 6 (ggml's Q4_1 kernel takes one row at a time).
GGML_MAX_ROWS = 3
# The same for weights repacked for ggml's gemm (Q4_0 / Q4_1 layers of n % 8 == 0 rows, an AVX2 CPU),
# which unpacks a weight block once per 4 rows. Prompt chunks against fbgemm's fp16, alternated
# in one process (bench/ggml_repack.py, SmolLM2, 2026-11-27): 1.04x at 16 tokens, 0.81-0.89x from
# 64; decode steps: model.DECODE_LAYERS_X8_MAX_ROWS.
GGML_X8_MAX_ROWS = 16
# The same for an lm_head's Q8_0 blocks repacked for Tandem's AVX512-VNNI kernel (``Linear``'s
# ``head``; ``Kernels.repack_q8_x16``), which reads half the bytes fbgemm's fp16 does. SmolLM2's head
# (49152 x 576), paired in one process on a 2-core AVX512-VNNI EPYC (bench/q8_head.py, 2026-12-07):
# 1.8-2.5x faster than fbgemm's fp16 at 1-8 rows, 3.1x at 16, 2.4-2.9x at 32-128; against ggml's
# vec_dot (the 1-3 row calls before) 0.69 against 1.16 ms at one row. Beyond 128 rows (only
# position_logits' calls: a step computes the head for its last positions) the wide copy. Where
# the wide copy is oneDNN's bf16 (AMX tiles or AVX512-BF16: 3.6-3.9x fbgemm's fp16 at 64-512 rows on
# an AMX host) only calls of up to GGML_Q8_X16_BF16_MAX_ROWS rows, where the bytes read decide (not
# measured on such a host).
GGML_Q8_X16_MAX_ROWS = 128
GGML_Q8_X16_BF16_MAX_ROWS = 16
# The same for Tandem's AVX2 kernel (``Kernels.repack_q8_x8``) where the CPU has no AVX512-VNNI
# (none of those has a bf16 wide copy). SmolLM2's head on a 2-core AVX2 EPYC (Zen 3), paired in one
# process (bench/q8_head.py, 2026-12-07): 1.2-1.8x faster than fbgemm's fp16 at 1-128 rows; decode
# steps of 1-3 rows 1.06-1.18x faster than on ggml's vec_dot.
GGML_Q8_X8_MAX_ROWS = 128
# The block types tried, in order, for a layer of the ggml format: the first that holds the
# layer's weights exactly is used (llama.cpp's usual GGUF body and embedding types).
GGML_EXACT_TYPES = (ggml_kernels.GgmlType.Q4_1, ggml_kernels.GgmlType.Q4_0, ggml_kernels.GgmlType.Q8_0)
_WARNING_FILTERS_LOCK = threading.Lock()

# Picks the ggml format's wide copy (``ggml_wide_format``): auto, fp16 or bf16. Read when a model loads.
GGML_WIDE_ENV = "TANDEM_GGML_WIDE"
GGML_WIDE_CHOICES = ("auto", "fp16", "bf16")

# Decode-sized batch the oneDNN packed layout is tuned for; it stays correct (and faster than the
# plain layout in our measurements) from 1 to hundreds of rows.
_PACK_BATCH_HINT = 8
# oneDNN builds (JIT-compiles) a primitive for each new number of rows a packed weight is called
# with, and keeps the last 1024 in an LRU cache. Measured on an AMX host (SmolLM2's four projection
# shapes, bf16, 2 threads): 4-30 ms for a new row count against 0.5-8 ms cached; past 256 distinct
# counts the cache evicts and every count pays again. Prompts and hybrid steps have any row count,
# so a server would keep compiling. Calls of more than ONEDNN_EXACT_ROWS rows are padded up to one
# of 8 sizes per octave (``onednn_rows``): 4 + 8 a doubling, a few hundred primitives in all. The
# padded rows cost nothing measurable (oneDNN's row tails): 30 row counts of 35-698 took 58.5 ms
# padded against 56.6 ms exact, all cached.
ONEDNN_EXACT_ROWS = 32


def onednn_rows(num_rows: int) -> int:
    """The row count a oneDNN call of ``num_rows`` rows runs at: itself up to
    ONEDNN_EXACT_ROWS, else rounded up to a multiple of an eighth of its power of two (at least 8)."""
    if num_rows <= ONEDNN_EXACT_ROWS:
        return num_rows
    step = max(8, 1 << ((num_rows - 1).bit_length() - 4))
    return -(-num_rows // step) * step


def can_pack_fp32(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pre-pack fp32 linear weights on this CPU build."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def can_run_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX); elsewhere
    it emulates them, slower than fp32."""
    return can_pack_fp32(torch.float32) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_run_fp16() -> bool:
    """Whether this torch build has fbgemm's fp16-weight linear (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic_fp16")


def can_run_int8() -> bool:
    """Whether this torch build has fbgemm's dynamic int8 linear (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bf16 matmuls run on them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return probe is not None and bool(probe())


def has_bf16_dot() -> bool:
    """Whether this CPU computes bf16 dot products in hardware, which oneDNN's bf16 matmuls run on:
    AMX tiles or AVX512-BF16 (``vdpbf16ps``). Without either, oneDNN's bf16 kernels (where it has
    them: ``can_run_bf16``) convert each value to fp32 first, so the wide copy stays fp16 there
    (not measured: no such host so far)."""
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe is not None and probe() for probe in probes)


def ggml_wide_format() -> WeightFormat:
    """The format of the ggml format's wide copy, which runs the calls of more rows than ggml's
    kernels take: bf16 (oneDNN) where the CPU has a bf16 dot product (``has_bf16_dot``), fp16
    (fbgemm) elsewhere.
    ``TANDEM_GGML_WIDE`` (auto, fp16, bf16) overrides it, for A/B measurements and the accuracy
    benchmark; bf16 on a CPU without native bf16 matmuls falls back to fp16 with a warning."""
    choice = os.environ.get(GGML_WIDE_ENV, "auto")
    if choice not in GGML_WIDE_CHOICES:
        raise ValueError(f"{GGML_WIDE_ENV}={choice!r}: choose one of {', '.join(GGML_WIDE_CHOICES)}")
    if choice == "fp16" or (choice == "auto" and not has_bf16_dot()):
        return WeightFormat.FP16
    if not can_run_bf16():
        if choice == "bf16":
            log.warning("%s=bf16: this CPU has no native bf16 matmuls; the wide copy runs fp16", GGML_WIDE_ENV)
        return WeightFormat.FP16
    return WeightFormat.BF16


def best_format() -> WeightFormat:
    """The fastest format that keeps fp32's accuracy here: fbgemm fp16, else oneDNN-packed fp32,
    else plain fp32.

    bf16 runs about as fast where the CPU has native bf16, but it rounds every activation to
    bf16, which turns the last-bit differences between kernels (batch shape, thread count) into
    bf16-sized ones: greedy outputs then depend on how requests were batched. fp16 weights with
    fp32 activations keep fp32's behaviour and agree with it more closely (bench/quant.py)."""
    if can_run_fp16():
        return WeightFormat.FP16
    if can_pack_fp32(torch.float32):
        return WeightFormat.FP32_PACKED
    return WeightFormat.FP32


def effective_format(fmt: WeightFormat, dtype: torch.dtype, device: torch.device | str = "cpu") -> WeightFormat:
    """The format actually run for weights of ``dtype`` on ``device``: the derived formats are
    CPU kernels (oneDNN, fbgemm) that need fp32 source weights; on a GPU, and for weights of
    another dtype, the weights run as they are (``F.linear``, cuBLAS on CUDA)."""
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        return WeightFormat.FP32
    runnable = {
        WeightFormat.FP32: True,
        WeightFormat.FP32_PACKED: can_pack_fp32(dtype),
        WeightFormat.BF16: can_run_bf16(),
        WeightFormat.FP16: can_run_fp16(),
        WeightFormat.INT8: can_run_int8(),
        WeightFormat.GGML: can_run_fp16() and ggml_kernels.load() is not None,
    }
    if runnable[fmt]:
        return fmt
    if fmt == WeightFormat.GGML and runnable[WeightFormat.FP16]:
        _warn_no_ggml()
        return WeightFormat.FP16  # its large-batch half
    return WeightFormat.FP32_PACKED if runnable[WeightFormat.FP32_PACKED] else WeightFormat.FP32


@functools.cache
def _warn_no_ggml() -> None:
    log.warning("weight format ggml: ggml's kernels are not built on this machine (tandem models "
                "build-kernels, %s); running fp16", ggml_kernels.library_path())


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row: ``weight ≈ q * scale[:, None]``.

    Returns ``(q [out, in] int8, scale [out] fp32)``; an all-zero row gets scale 1.
    """
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0  # [out]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


class Linear:
    """``y = x @ W^T + b`` in one of the weight formats; x and y are fp32 in every format.

    ``weight`` [out_features, in_features] is the shared source; a derived format keeps a
    private copy (``derived_bytes``) and never writes the source.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: WeightFormat,
                 smooth: torch.Tensor | None = None, out_divisor: torch.Tensor | None = None,
                 head: bool = False) -> None:
        """int8 only (``tandem.engine.smoothing``): the derived weight is ``weight * smooth`` per
        input channel, so the caller must feed ``x / smooth`` (the model folds that division
        into the layer before); ``out_divisor`` [out_features] divides output rows, which is how
        a projection takes on the next layer's division. ``head``: the model's lm_head, whose
        Q8_0 blocks (the ggml format) run Tandem's VNNI kernel where the CPU has one
        (``GGML_Q8_X16_MAX_ROWS``), else its AVX2 kernel (``GGML_Q8_X8_MAX_ROWS``); the decoder
        layers' go whole into ``DecodeLayers``, which takes ggml's layouts only."""
        self.weight = weight  # [out_features, in_features]
        self.bias = bias
        self.format = effective_format(fmt, weight.dtype, weight.device)
        self.derived_bytes = 0
        self._packed: object = None
        self._bias16: torch.Tensor | None = None
        self.ggml_type: ggml_kernels.GgmlType | None = None  # the blocks' type (as the GGUF stored them)
        # the weights as the C kernels take them (repacked where they can be), set with _kernels
        self.ggml_projection: ggml_kernels.Projection | None = None
        self.ggml_repacked = False  # ggml_projection in ggml's 8-row layout (Kernels.repack_x8)
        self._kernels: ggml_kernels.Kernels | None = None
        # what runs the calls ggml's kernels do not take: the format itself, or the ggml format's wide copy
        self.wide_format = self.format
        if self.format == WeightFormat.GGML:
            self._ggml_blocks(weight, head)
            self.wide_format = ggml_wide_format()
        if self.wide_format == WeightFormat.FP16:
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
            self.derived_bytes += weight.numel() * 2
        elif self.wide_format == WeightFormat.FP32_PACKED:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
            self.derived_bytes = weight.numel() * 4
        elif self.wide_format == WeightFormat.BF16:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), _PACK_BATCH_HINT)
            self._bias16 = None if bias is None else bias.to(torch.bfloat16)
            self.derived_bytes += weight.numel() * 2
        elif self.wide_format == WeightFormat.INT8:
            derived = weight.float()
            if smooth is not None:
                derived = derived * smooth
            if out_divisor is not None:
                derived = derived / out_divisor[:, None]
                self.bias = bias = None if bias is None else bias / out_divisor
            q, scale = quantize_per_channel_int8(derived)
            # catch_warnings swaps the process's filters: layers built on several threads
            # (LlamaModel) take turns here, or one could restore another's "ignore" for good
            with _WARNING_FILTERS_LOCK, warnings.catch_warnings():
                # quantized tensors are deprecated as a user-facing type; fbgemm's packing still
                # takes one, and nothing else of it outlives this constructor.
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch._make_per_channel_quantized_tensor(
                    q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
                )
                # the bias is added after the per-row rescale, not inside fbgemm's call
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            self.derived_bytes = q.numel() + scale.numel() * 4

    def _ggml_blocks(self, weight: torch.Tensor, head: bool) -> None:
        """The first of ``GGML_EXACT_TYPES`` whose blocks dequantize to ``weight`` bit for bit;
        none (a layer not from a GGUF of those types) leaves the layer on its wide copy alone.
        Q4 blocks are repacked for ggml's gemm, a ``head``'s Q8_0 blocks for Tandem's VNNI or AVX2 kernel."""
        kernels = ggml_kernels.load()
        assert kernels is not None  # effective_format checked
        n, k = weight.shape
        for gtype in GGML_EXACT_TYPES:
            if k % 32:
                break
            blocks = kernels.quantize(weight, gtype)
            if torch.equal(kernels.dequantize(blocks, gtype, n, k), weight):
                self.ggml_type, self._kernels = gtype, kernels
                self.ggml_projection = ggml_kernels.Projection(blocks, gtype)
                repack = ggml_kernels.repack_on()
                if head and gtype == ggml_kernels.GgmlType.Q8_0:
                    # the plain rows are not kept: VNNI's layout, else AVX2's, where the CPU runs one
                    for repacked_head, head_type in ((kernels.repack_q8_x16, ggml_kernels.GgmlType.Q8_X16),
                                                     (kernels.repack_q8_x8, ggml_kernels.GgmlType.Q8_X8)):
                        head_blocks = repacked_head(blocks, n, k) if repack else None
                        if head_blocks is not None:
                            self.ggml_projection = ggml_kernels.Projection(head_blocks, head_type)
                            break
                elif repack and (repacked := kernels.repack_x8(blocks, gtype, n, k)) is not None:
                    # the plain rows are not kept
                    self.ggml_projection = ggml_kernels.Projection(repacked[0], ggml_kernels.GgmlType.Q4_X8,
                                                                   repacked[1])
                    self.ggml_repacked = True
                    self.derived_bytes += 0 if repacked[1] is None else repacked[1].numel() * 4
                self.derived_bytes += self.ggml_projection.blocks.numel()
                return

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        projection = self.ggml_projection
        if projection is not None and x.shape[0] <= self.ggml_max_rows():
            assert self._kernels is not None
            out = self._kernels.linear(x, projection.blocks, projection.gtype, self.weight.shape[0], projection.corr)
            return out if self.bias is None else out.add_(self.bias)
        wide = self.wide_format
        if wide == WeightFormat.BF16:
            return self._onednn(x, torch.bfloat16, self._bias16).float()
        if wide == WeightFormat.FP32_PACKED:
            return self._onednn(x, torch.float32, self.bias)
        if wide == WeightFormat.FP16:
            out = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self._packed)
            return out
        if wide == WeightFormat.INT8:
            return self._int8(x.contiguous())
        return F.linear(x, self.weight, self.bias)

    def ggml_max_rows(self) -> int:
        """The most rows a call runs on the ggml blocks (read at every call, so tests may change
        the limits); more run on the wide copy."""
        projection = self.ggml_projection
        if projection is not None and projection.gtype == ggml_kernels.GgmlType.Q8_X16:
            return GGML_Q8_X16_BF16_MAX_ROWS if self.wide_format == WeightFormat.BF16 else GGML_Q8_X16_MAX_ROWS
        if projection is not None and projection.gtype == ggml_kernels.GgmlType.Q8_X8:
            return GGML_Q8_X8_MAX_ROWS
        return GGML_X8_MAX_ROWS if self.ggml_repacked else GGML_MAX_ROWS

    def _onednn(self, x: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
        """oneDNN's matmul on the packed weight, its rows padded (with zeros) to ``onednn_rows``
        so that it runs on one of a few compiled primitives; the padding's rows are cut off."""
        num_rows = x.shape[0]
        rows = onednn_rows(num_rows) if x.dim() == 2 else num_rows
        if rows == num_rows:
            x = x.to(dtype)
        else:
            padded = x.new_empty((rows, x.shape[1]), dtype=dtype)
            padded[:num_rows].copy_(x)
            padded[num_rows:].zero_()
            x = padded
        out = torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        return out[:num_rows]

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's dynamic int8 linear with one activation scale per row. fbgemm scales the
        whole call by its extremes; dividing each row by its own largest magnitude first (and
        multiplying the output back, the layer being linear) gives every token the full int8
        range. A single row needs no rescale. reduce_range: 7-bit activations, so fbgemm's
        u8*s8 pair sums cannot saturate int16."""
        if x.shape[0] <= 1:
            out = torch.ops.quantized.linear_dynamic(x, self._packed, True)
        else:
            rows = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_min_(1e-30)
            out = torch.ops.quantized.linear_dynamic(x / rows, self._packed, True).mul_(rows)
        return out if self.bias is None else out.add_(self.bias)
