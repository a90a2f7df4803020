"""Weights and KV blocks opened through CUDA IPC handles are the exporter's bytes: another
process reads them, computes on them, and its writes land in the exporter's memory."""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_another_process_reads_and_writes_the_exported_weights_and_pool(seed: int) -> None:
    from tandem.cuda.ipc import export_tensors
    from tandem.engine.attention import make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec
    from tandem.engine.model import LlamaModel
    from tandem.engine.random_weights import random_weights, tiny_config
    from tandem.engine.runner import ModelRunner, SeqInput

    gen = torch.Generator().manual_seed(seed)
    config = tiny_config()
    weights = random_weights(config, torch.float32, "cuda", seed=seed, std=0.2)
    num_blocks = 32
    pool = KVPool.create(KVPoolSpec.for_model(config, num_blocks, 16), "cuda")
    runner = ModelRunner(LlamaModel(config, weights, make_backend("torch", config.num_heads)), pool)
    prompt_len = int(torch.randint(5, 60, (1,), generator=gen))
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist()
    blocks = torch.randperm(num_blocks - 1, generator=gen)[:5].tolist()  # block num_blocks-1: the mark
    first = int(runner.forward([SeqInput(prompt, 0, blocks)]).argmax())
    expected = runner.forward([SeqInput([first], prompt_len, blocks)])[0]
    mark_block, mark_value = num_blocks - 1, 3.0 + seed
    msg = {
        "weights": base64.b64encode(export_tensors(weights)).decode(),
        "pool": base64.b64encode(export_tensors({"kv": pool.tensor})).decode(),
        "num_blocks": num_blocks, "prompt_len": prompt_len, "next_token": first, "blocks": blocks,
        "mark_block": mark_block, "mark_value": mark_value,
    }
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "tests.gpu._ipc_child"], input=json.dumps(msg) + "\n",
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, tensor in weights.items():
        assert math.isclose(child["sums"][name], float(tensor.double().sum()), rel_tol=0, abs_tol=1e-9), name
    # The child's decode step read the parent's K/V: same logits as the parent's own step.
    torch.testing.assert_close(torch.tensor(child["logits"]), expected.cpu(), rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    assert bool((pool.tensor[:, :, mark_block] == mark_value).all())
    assert bool((pool.tensor[:, :, blocks[0]] != mark_value).any())


def test_bad_bytes_get_a_clear_error() -> None:
    from tandem.cuda.ipc import open_tensors

    with pytest.raises(ValueError, match="not a"):
        open_tensors(b"\x00garbage")
    with pytest.raises(ValueError, match="not a"):
        open_tensors(json.dumps({"format": "other"}).encode())
