"""``tandem chat``: one chat completion from a model on this machine, streamed to stdout.

Runs the single-process engine (the mesh runs the same engine split across processes).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tandem.engine.errors import TandemError

DEFAULT_MESSAGE = "Explain in two sentences why the sky is blue."


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "chat", help="run one chat completion in this process and print it"
    )
    parser.add_argument("message", nargs="?", default=DEFAULT_MESSAGE, help="the user message")
    parser.add_argument("--model", default="default", help="a model directory, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--system", default=None, help="an optional system message")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm import LLMEngine
    from tandem.engine.model_cache import resolve_model
    from tandem.engine.sampling import SamplingParams
    from tandem.engine.tokenizer import IncrementalDetokenizer, Tokenizer
    from tandem.engine.weights import parse_dtype

    try:
        model_dir = resolve_model(args.model)
        tokenizer = Tokenizer.from_dir(model_dir)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.message})
        prompt = tokenizer.encode_chat(messages)
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
        )
        started = time.perf_counter()
        engine = LLMEngine.from_dir(model_dir, dtype=parse_dtype(args.dtype), kv_cache_bytes=256 << 20)
        loaded = time.perf_counter()
        engine.add_request(prompt, params)
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[{model_dir.name} on cpu, loaded in {loaded - started:.1f}s]", file=sys.stderr)
    print(f"user: {args.message}\nassistant: ", end="", flush=True)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    num_tokens = 0
    first_token_at = None
    finish_reason = None
    while engine.has_unfinished():
        for out in engine.step():
            num_tokens += 1
            first_token_at = first_token_at or time.perf_counter()
            print(detok.step(out.token_id), end="", flush=True)
            finish_reason = out.finish_reason or finish_reason
    print(detok.flush())
    done = time.perf_counter()
    assert first_token_at is not None
    decode_rate = (num_tokens - 1) / (done - first_token_at) if num_tokens > 1 else 0.0
    print(
        f"[{num_tokens} tokens, finish_reason={finish_reason}, "
        f"TTFT {1000 * (first_token_at - loaded):.0f} ms, {decode_rate:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0
