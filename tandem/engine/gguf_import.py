"""Import a llama-architecture GGUF file into a Hugging Face style model directory.

The serving runtime only understands the Hugging Face layout (``config.json``,
``*.safetensors``, ``tokenizer.json``), so a GGUF is converted once, up front:

- weights are dequantized to float32 with ``gguf.quants.dequantize`` and renamed to the
  Hugging Face names; the q/k projection rows are put back in Hugging Face's rope layout
  (llama.cpp's converter interleaves them, see ``unpermute_qk``);
- the tokenizer is rebuilt with the ``tokenizers`` library from the vocabulary, merges and
  token types stored in the GGUF metadata (byte-level BPE natively; other tokenizer models
  through transformers' GGUF converter when it is installed);
- the chat template, special tokens and end-of-turn tokens go to ``tokenizer_config.json``,
  ``config.json`` and ``generation_config.json``.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.engine.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Per-layer GGUF tensor suffix -> Hugging Face name inside ``model.layers.N``.
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Tokens that close a chat turn. The GGUF's eos is often the document end (<|endoftext|>),
# while the chat template ends each assistant turn with one of these; generation has to
# stop on both, so every one the template uses is added to eos_token_id.
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# Pre-tokenizer splits for byte-level BPE vocabularies, keyed by tokenizer.ggml.pre.
# They mirror llama.cpp's llama-vocab.cpp (which is what the GGUF was validated against)
# and the original tokenizer.json files of these families.
_GPT2_SPLIT_PRE_TYPES = frozenset({"gpt2", "gpt-2", "mpt", "olmo", "jais"})
# GPT-2 regex after splitting every digit on its own (StarCoder-derived vocabularies).
_DIGIT_SPLIT_PRE_TYPES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_LLAMA3_PRE_TYPES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _LlamaShape:
    """Hyper-parameters read from the ``llama.*`` metadata keys."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a llama-architecture GGUF at ``gguf_path`` into a model directory at ``out_dir``.

    Writes ``config.json``, ``model.safetensors`` (float32), ``tokenizer.json``,
    ``tokenizer_config.json`` and ``generation_config.json``; ``out_dir`` is created if needed
    and files already in it are overwritten. The write is not atomic: callers that need an
    all-or-nothing directory (``model_cache``) import into a temporary directory and rename it.
    Returns ``out_dir`` as a ``Path``.

    Raises ModelLoadError when the file is missing, is not a GGUF, is not a llama
    architecture, or lacks a tensor or metadata key the conversion needs.
    """
    path = Path(gguf_path)
    reader = _open_reader(path)
    architecture = _get(reader, "general.architecture")
    if architecture != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture is {architecture!r}; only 'llama' GGUF files can be imported")
    shape = _read_shape(reader, path)
    weights, rope_scaling = _convert_weights(reader, shape, path)
    tokenizer_json, tokenizer_config, special_ids = _build_tokenizer(reader, path, shape.context_length)

    vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.context_length,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special_ids["bos"],
        "eos_token_id": special_ids["eos"],
        "torch_dtype": "float32",
    }
    if special_ids["pad"] is not None:
        config["pad_token_id"] = special_ids["pad"]
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    generation_config: dict[str, Any] = {
        "bos_token_id": special_ids["bos"],
        "eos_token_id": special_ids["eos"],
    }
    if special_ids["pad"] is not None:
        generation_config["pad_token_id"] = special_ids["pad"]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _save_safetensors(weights, out / "model.safetensors")
    # safetensors creates its file 0600; give it the umask-derived mode of the other files so
    # that services running as another user can map the shared cache.
    shutil.copymode(out / "tokenizer.json", out / "model.safetensors")
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", generation_config)
    # config.json last: a reader that sees it can expect the rest to be there.
    _write_json(out / "config.json", config)
    return out


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(weights, n_head)`` on a q or k projection.

    llama.cpp stores each head's rows as (pairs, 2) so that its rope rotates adjacent
    elements; Hugging Face's rope rotates the two halves of a head. The inverse is
    reshape(n_head, head_dim // 2, 2, in) -> swap axes 1 and 2 -> reshape back.
    ``weight`` is ``[num_heads * head_dim, in_features]``; the result has the same shape.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ModelLoadError(f"projection with {rows} rows cannot be split into {num_heads} rope heads")
    head_half = rows // num_heads // 2
    return np.ascontiguousarray(
        weight.reshape(num_heads, head_half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _open_reader(path: Path) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from None


_MISSING = object()


def _get(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata ``key`` as a Python object (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    if hasattr(field, "contents"):
        return field.contents()
    return _decode_field_parts(field)


def _decode_field_parts(field: Any) -> Any:
    # gguf releases before ReaderField.contents(): values are numpy views into field.parts.
    from gguf import GGUFValueType

    def scalar(part_index: int, value_type: Any) -> Any:
        part = field.parts[part_index]
        if value_type == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(index, field.types[-1]) for index in field.data]
    return scalar(field.data[0], field.types[0])


def _read_shape(reader: Any, path: Path) -> _LlamaShape:
    hidden = int(_get(reader, "llama.embedding_length"))
    num_heads = int(_get(reader, "llama.attention.head_count"))
    num_kv_heads = int(_get(reader, "llama.attention.head_count_kv", num_heads))
    head_dim = int(_get(reader, "llama.attention.key_length", hidden // num_heads))
    rope_dim = int(_get(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embedding (rope dimension {rope_dim}, head_dim {head_dim}) is not supported"
        )
    return _LlamaShape(
        num_layers=int(_get(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_get(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_get(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_get(reader, "llama.rope.freq_base", 10000.0)),
        context_length=int(_get(reader, "llama.context_length", 2048)),
    )


def _convert_weights(
    reader: Any, shape: _LlamaShape, path: Path
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """All tensors dequantized to float32 under Hugging Face names, plus rope_scaling if any."""
    from gguf.quants import dequantize

    by_name = {tensor.name: tensor for tensor in reader.tensors}
    rope_scaling = _rope_scaling_from_metadata(reader)
    rope_freqs = by_name.pop("rope_freqs.weight", None)

    weights: dict[str, np.ndarray] = {}
    unknown: list[str] = []
    for name, tensor in by_name.items():
        hf_name = _hf_name(name, shape.num_layers)
        if hf_name is None:
            unknown.append(name)
            continue
        # GGUF lists dimensions fastest-first; numpy / torch want them slowest-first.
        dims = tuple(int(d) for d in reversed(tensor.shape))
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(dims)
        if name.endswith("attn_q.weight"):
            array = unpermute_qk(array, shape.num_heads)
        elif name.endswith("attn_k.weight"):
            array = unpermute_qk(array, shape.num_kv_heads)
        weights[hf_name] = np.ascontiguousarray(array)
    if unknown:
        raise ModelLoadError(f"{path}: tensors not part of a llama decoder: {', '.join(sorted(unknown)[:8])}")

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(shape.num_layers):
        expected.update(f"model.layers.{layer}.{suffix}" for suffix in _LAYER_TENSORS.values())
    missing = sorted(expected - weights.keys())
    if missing:
        raise ModelLoadError(f"{path}: GGUF is missing tensors {', '.join(missing[:8])}")
    _check_shapes(weights, shape, path)

    if rope_freqs is not None:
        factors = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float64).reshape(-1)
        rope_scaling = _llama3_scaling_from_factors(factors, shape, path)
    return weights, rope_scaling


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < num_layers:
        suffix = _LAYER_TENSORS.get(parts[2])
        if suffix is not None:
            return f"model.layers.{parts[1]}.{suffix}"
    return None


def _check_shapes(weights: dict[str, np.ndarray], shape: _LlamaShape, path: Path) -> None:
    q_rows = shape.num_heads * shape.head_dim
    kv_rows = shape.num_kv_heads * shape.head_dim
    expected = {
        "self_attn.q_proj.weight": (q_rows, shape.hidden_size),
        "self_attn.k_proj.weight": (kv_rows, shape.hidden_size),
        "self_attn.v_proj.weight": (kv_rows, shape.hidden_size),
        "self_attn.o_proj.weight": (shape.hidden_size, q_rows),
        "mlp.gate_proj.weight": (shape.intermediate_size, shape.hidden_size),
        "mlp.up_proj.weight": (shape.intermediate_size, shape.hidden_size),
        "mlp.down_proj.weight": (shape.hidden_size, shape.intermediate_size),
    }
    for layer in range(shape.num_layers):
        for suffix, dims in expected.items():
            name = f"model.layers.{layer}.{suffix}"
            if weights[name].shape != dims:
                raise ModelLoadError(f"{path}: {name} has shape {weights[name].shape}, expected {dims}")
    embed = weights["model.embed_tokens.weight"]
    if embed.ndim != 2 or embed.shape[1] != shape.hidden_size:
        raise ModelLoadError(f"{path}: token embedding has shape {embed.shape}, expected [vocab, {shape.hidden_size}]")


def _rope_scaling_from_metadata(reader: Any) -> dict[str, Any] | None:
    rope_type = _get(reader, "llama.rope.scaling.type", None)
    if rope_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(_get(reader, "llama.rope.scaling.factor", 1.0))}
    original = _get(reader, "llama.rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _llama3_scaling_from_factors(factors: np.ndarray, shape: _LlamaShape, path: Path) -> dict[str, Any]:
    """Recover Llama 3.1 rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores per-frequency divisors instead of the parameters. Every Llama 3.x release
    uses low_freq_factor 1, high_freq_factor 4 and an 8192-token original context, and the
    largest divisor is ``factor``; the guess is accepted only if it reproduces the tensor.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_factors(scaling, shape), factors, rtol=1e-4, atol=1e-4):
        raise ModelLoadError(f"{path}: rope_freqs tensor does not match Llama 3 rope scaling; cannot import it")
    return scaling


def _llama3_factors(scaling: dict[str, Any], shape: _LlamaShape) -> np.ndarray:
    # The same formula llama.cpp's converter uses to produce rope_freqs.
    dims = np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim
    freqs = 1.0 / (shape.rope_theta**dims)
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen = old_context / scaling["low_freq_factor"]
    high_wavelen = old_context / scaling["high_freq_factor"]
    result = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            result.append(1.0)
        elif wavelen > low_wavelen:
            result.append(scaling["factor"])
        else:
            smooth = (old_context / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            result.append(1.0 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.asarray(result)


def _build_tokenizer(reader: Any, path: Path, context_length: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(tokenizer.json text, tokenizer_config dict, special ids)`` from the GGUF metadata.

    The special ids dict has ``bos`` (int or None), ``eos`` (list of ints) and ``pad``.
    """
    tokens: list[str] = list(_get(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(_get(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    tokenizer_model = _get(reader, "tokenizer.ggml.model")
    pre_type = _get(reader, "tokenizer.ggml.pre", None)
    add_bos = bool(_get(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_get(reader, "tokenizer.ggml.add_eos_token", False))

    def token_at(key: str) -> str | None:
        token_id = _get(reader, key, None)
        if token_id is None or not 0 <= int(token_id) < len(tokens):
            return None
        return tokens[int(token_id)]

    bos_token = token_at("tokenizer.ggml.bos_token_id")
    eos_token = token_at("tokenizer.ggml.eos_token_id")
    if tokenizer_model == "gpt2" and (pre_type is None or _byte_level_pre_tokenizer(pre_type) is not None):
        tokenizer_json = _byte_level_tokenizer_json(
            tokens,
            token_types,
            list(_get(reader, "tokenizer.ggml.merges")),
            pre_type,
            bos_token,
            eos_token,
            add_bos,
            add_eos,
        )
    else:
        tokenizer_json = _tokenizer_json_via_transformers(path, tokenizer_model)

    chat_template = _chat_template(reader)
    template_text = json.dumps(chat_template) if chat_template is not None else ""
    ids = {token: index for index, token in enumerate(tokens)}

    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = _get(reader, key, None)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    for token in END_OF_TURN_TOKENS:
        if token in ids and token in template_text and ids[token] not in eos_ids:
            eos_ids.append(ids[token])

    pad_id = _get(reader, "tokenizer.ggml.padding_token_id", None)
    bos_id = _get(reader, "tokenizer.ggml.bos_token_id", None)
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "model_max_length": context_length,
        # Decoding must give back the exact text; HF's clean-up would eat spaces before punctuation.
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    special_ids = {
        "bos": int(bos_id) if bos_id is not None else None,
        "eos": eos_ids,
        "pad": int(pad_id) if pad_id is not None else None,
    }
    return tokenizer_json, tokenizer_config, special_ids


def _chat_template(reader: Any) -> str | list[dict[str, str]] | None:
    """The default template, or HF's list form when the GGUF also carries named ones."""
    default = _get(reader, "tokenizer.chat_template", None)
    prefix = "tokenizer.chat_template."
    named = {key[len(prefix) :]: _get(reader, key) for key in reader.fields if key.startswith(prefix)}
    if not named:
        return default
    templates = [{"name": "default", "template": default}] if default is not None else []
    templates += [{"name": name, "template": text} for name, text in sorted(named.items())]
    return templates


def _byte_level_pre_tokenizer(pre_type: str | None) -> Any:
    """The tokenizers pre-tokenizer for a byte-level vocabulary, or None if the type is unknown."""
    from tokenizers import Regex, pre_tokenizers

    if pre_type is None or pre_type in _GPT2_SPLIT_PRE_TYPES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type in _DIGIT_SPLIT_PRE_TYPES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre_type in _LLAMA3_PRE_TYPES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return None


def _byte_level_tokenizer_json(
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    pre_type: str | None,
    bos_token: str | None,
    eos_token: str | None,
    add_bos: bool,
    add_eos: bool,
) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=False)):
        if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED) or set(token) <= alphabet:
            # Added tokens are matched on the raw text, so they keep their raw spelling.
            vocab.setdefault(token, index)
        else:
            # A normal token written in plain UTF-8 instead of the byte alphabet.
            vocab.setdefault("".join(spelling[b] for b in token.encode("utf-8")), index)
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre_type)
    backend.decoder = decoders.ByteLevel()

    control = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == _TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == _TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)

    single, pair, specials = "$A", "$A $B:1", []
    if add_bos and bos_token is not None:
        single, pair = f"{bos_token} {single}", f"{bos_token} $A {bos_token}:1 $B:1"
        specials.append((bos_token, vocab[bos_token]))
    if add_eos and eos_token is not None:
        single, pair = f"{single} {eos_token}", f"{pair} {eos_token}:1"
        specials.append((eos_token, vocab[eos_token]))
    if specials:
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    text: str = backend.to_str(pretty=False)
    return text


def _tokenizer_json_via_transformers(path: Path, tokenizer_model: str) -> str:
    # Sentencepiece-style vocabularies need the normalizer/decoder rules transformers knows.
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ModelLoadError(
            f"{path}: converting a {tokenizer_model!r} GGUF tokenizer needs transformers "
            "(pip install transformers); only byte-level BPE ('gpt2') tokenizers convert without it"
        ) from None
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{path}: cannot convert the GGUF tokenizer: {exc}") from None
    text: str = hf_tokenizer.backend_tokenizer.to_str(pretty=False)
    return text


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _save_safetensors(weights: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    # format=pt: transformers refuses safetensors files without it.
    save_file(weights, str(path), metadata={"format": "pt"})


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
