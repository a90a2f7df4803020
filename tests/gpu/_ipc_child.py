"""Child process of test_cuda_ipc: opens the parent's tensors from handle bytes on stdin, checks
them against the sums the parent sent, runs the model over them and writes into the KV pool.
Prints one JSON line. Run as ``python -m tests.gpu._ipc_child``."""

from __future__ import annotations

import base64
import json
import sys

import torch


def main() -> None:
    msg = json.loads(sys.stdin.readline())
    from tandem.cuda.ipc import open_tensors
    from tandem.engine.attention import make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec
    from tandem.engine.model import LlamaModel
    from tandem.engine.random_weights import tiny_config
    from tandem.engine.runner import ModelRunner, SeqInput

    weights = open_tensors(base64.b64decode(msg["weights"]))
    pool_tensor = open_tensors(base64.b64decode(msg["pool"]))["kv"]
    sums = {k: float(t.double().sum()) for k, t in weights.items()}
    config = tiny_config()
    spec = KVPoolSpec.for_model(config, msg["num_blocks"], 16)
    runner = ModelRunner(LlamaModel(config, weights, make_backend("torch", config.num_heads)), KVPool(spec, pool_tensor))
    # Decode one token over the K/V the parent's prefill left in the shared pool.
    logits = runner.forward([SeqInput([msg["next_token"]], msg["prompt_len"], msg["blocks"])])
    pool_tensor[:, :, msg["mark_block"]].fill_(msg["mark_value"])  # a write the parent must see
    torch.cuda.synchronize()
    print(json.dumps({"sums": sums, "pool_ptr": pool_tensor.data_ptr(), "logits": logits[0].tolist()}), flush=True)


if __name__ == "__main__":
    main()
