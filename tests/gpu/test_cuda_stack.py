"""The whole stack on one GPU: gpu_agent --device cuda holds a tiny random model's weights and
the KV pool in GPU memory, prefill_svc and decode_svc (separate processes) map them by CUDA IPC
handle, and greedy generations through the router equal the CPU path's, for prompts of mixed
lengths and mixed output lengths; every block comes back."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from tandem.protocol import SamplingParams

pytestmark = pytest.mark.gpu


def _tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: TANDEM_GPU_TOKENIZER_DIR (a GPU machine has no model cache and
    no network), else the local model cache."""
    for candidate in (os.environ.get("TANDEM_GPU_TOKENIZER_DIR", ""),
                      str(Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct")):
        if candidate and (Path(candidate) / "tokenizer.json").exists():
            return Path(candidate)
    pytest.skip("no SmolLM2 tokenizer here: set TANDEM_GPU_TOKENIZER_DIR to a folder with its tokenizer files")


def _cpu_greedy(model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    from tandem.engine.attention import make_backend
    from tandem.engine.config import ModelConfig
    from tandem.engine.kv_pool import KVPool, KVPoolSpec
    from tandem.engine.model import LlamaModel
    from tandem.engine.quant import WeightFormat
    from tandem.engine.runner import ModelRunner, SeqInput
    from tandem.engine.weights import load_checkpoint

    config = ModelConfig.from_dir(model_dir)
    model = LlamaModel(config, load_checkpoint(model_dir, config, torch.float32),
                       make_backend("torch", config.num_heads), WeightFormat.FP32)
    runner = ModelRunner(model, KVPool.create(KVPoolSpec.for_model(config, 16, 16)))
    out = []
    for prompt, n in zip(prompts, lengths, strict=True):
        blocks = list(range(16))
        tokens = [int(runner.forward([SeqInput(prompt, 0, blocks)]).argmax())]
        while len(tokens) < n:
            tokens.append(int(runner.forward([SeqInput([tokens[-1]], len(prompt) + len(tokens) - 1, blocks)]).argmax()))
        out.append(tokens)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_the_stack_on_one_gpu_gives_the_cpu_paths_greedy_tokens(tmp_path: Path, seed: int) -> None:
    from tests.integration.mesh_client import generate, wait_all_blocks_free
    from tests.integration.stack import Stack
    from tests.tiny_models import write_tiny_model

    tok = _tokenizer_dir()
    model_dir = tmp_path / "model"
    # A wide initializer: logits stand apart, so GPU and CPU kernels' last bits cannot flip an argmax.
    write_tiny_model(model_dir, "llama", seed=seed, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                     max_position_embeddings=2048, rope_scaling=None, initializer_range=0.3)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tok / name).exists():
            shutil.copy(tok / name, model_dir / name)
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 150))] for _ in range(10)]
    lengths = [rng.randrange(4, 30) for _ in prompts]
    logs = tmp_path / "logs"
    logs.mkdir()
    with Stack(model_dir, logs, num_blocks=256, agent_args=["--device", "cuda"]) as stack:
        async def run() -> list[tuple[list[int], int]]:
            return await asyncio.gather(*(
                generate(stack.address("router"), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, lengths, strict=True)))

        results = asyncio.run(run())
        stats = asyncio.run(wait_all_blocks_free(stack))
        for name in ("prefill_svc", "decode_svc"):
            assert "by CUDA IPC handle" in stack.logs(name), stack.logs(name)[-2000:]
    assert stats.num_free_blocks == stats.num_blocks and stats.num_requests == 0
    assert [tokens for tokens, _ in results] == _cpu_greedy(model_dir, prompts, lengths)
