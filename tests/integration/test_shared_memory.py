"""Two processes share one copy of the weights and one KV pool through named shared memory.

A child process attaches both and prefills a prompt (writing K/V into the pool); the parent
then decodes the next token reading only what the child wrote, and must get the reference
logits. Nothing but names and block ids crosses between the processes.
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from pathlib import Path

import pytest
import torch

from tandem.engine.attention import make_backend
from tandem.engine.config import ModelConfig
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.model import LlamaModel
from tandem.engine.runner import ModelRunner, SeqInput
from tandem.engine.shm import SharedMemoryError, SharedTensorStore
from tandem.engine.weights import attach_weights, load_checkpoint, share_weights
from tests.tiny_models import write_tiny_model


def _child_prefill(model_dir: str, weights_name: str, pool_name: str, spec: KVPoolSpec,
                   ids: list[int], blocks: list[int], out: mp.Queue) -> None:
    config = ModelConfig.from_dir(model_dir)
    store, weights = attach_weights(weights_name)
    pool = KVPool.attach(spec, pool_name)
    runner = ModelRunner(LlamaModel(config, weights, make_backend("torch", config.num_heads)), pool)
    runner.forward([SeqInput(ids, 0, blocks)])
    maps = Path("/proc/self/maps").read_text()
    out.put((f"tandem-{weights_name}.bin" in maps, f"tandem-{pool_name}.bin" in maps))
    del store


def test_child_prefill_parent_decode_share_one_copy(tmp_path: Path) -> None:
    import transformers

    model_dir = write_tiny_model(tmp_path, "qwen3")
    config = ModelConfig.from_dir(model_dir)
    tag = uuid.uuid4().hex[:8]
    weights = load_checkpoint(model_dir, config, torch.float32)
    store = share_weights(weights, f"test-w-{tag}")
    spec = KVPoolSpec.for_model(config, num_blocks=8, block_size=4)
    pool = KVPool.create_shared(spec, f"test-kv-{tag}")
    try:
        ids = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(0)).tolist()
        blocks = [5, 2, 7, 0]
        ctx = mp.get_context("spawn")
        queue: mp.Queue = ctx.Queue()
        child = ctx.Process(target=_child_prefill,
                            args=(str(model_dir), f"test-w-{tag}", f"test-kv-{tag}", spec, ids[:10], blocks, queue))
        child.start()
        mapped_weights, mapped_pool = queue.get(timeout=120)
        child.join(timeout=60)
        assert child.exitcode == 0
        assert mapped_weights and mapped_pool

        _, shared = attach_weights(f"test-w-{tag}")
        runner = ModelRunner(LlamaModel(config, shared, make_backend("torch", config.num_heads)), pool)
        logits = runner.decode([ids[10]], [11], [blocks])
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits[0], ref, atol=2e-4, rtol=0)
    finally:
        store.unlink()
        assert pool.store is not None
        pool.store.unlink()


def test_attach_missing_store_names_it() -> None:
    with pytest.raises(SharedMemoryError, match="no-such-store"):
        SharedTensorStore.attach("no-such-store")


def test_create_twice_is_refused() -> None:
    name = f"test-dup-{uuid.uuid4().hex[:8]}"
    store = SharedTensorStore.from_tensors(name, {"x": torch.ones(3)})
    try:
        with pytest.raises(SharedMemoryError, match="already exists"):
            SharedTensorStore.from_tensors(name, {"x": torch.ones(3)})
        again = SharedTensorStore.attach(name)
        again.tensors["x"][1] = 5.0  # a write through one mapping is seen through the other
        assert store.tensors["x"].tolist() == [1.0, 5.0, 1.0]
    finally:
        store.unlink()


def test_store_files_are_readable_by_their_owner_only() -> None:
    """Weights and the KV pool (which holds users' prompts) are no other local user's to read."""
    import stat

    from tandem.engine.shm import SHM_DIR

    name = f"test-mode-{uuid.uuid4().hex[:8]}"
    store = SharedTensorStore.from_tensors(name, {"x": torch.ones(3)})
    try:
        files = sorted(SHM_DIR.glob(f"tandem-{name}*"))
        assert len(files) >= 2  # the data and its manifest
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        store.unlink()
