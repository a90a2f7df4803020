"""``tandem ask "message"``: one chat request to a running stack's gRPC API, streamed to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc

from tandem.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
from tandem.service.flags import add_flag


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("ask", help="send one chat message to a running stack")
    parser.add_argument("message", help="the user message")
    add_flag(parser, "--address", "127.0.0.1:50051", "the router's gRPC address")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    sampling = common_pb2.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_p=1.0,
                                         repetition_penalty=1.0)
    if args.seed is not None:
        sampling.seed = args.seed
    request = router_pb2.GenerateRequest(
        messages=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=args.message)]),
        sampling=sampling,
    )
    with grpc.insecure_channel(args.address) as channel:
        try:
            for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=600):
                print(response.text, end="", flush=True)
                if response.finish_reason:
                    usage = response.usage
                    print(f"\n[{usage.completion_tokens} tokens, prompt {usage.prompt_tokens}, "
                          f"finish {common_pb2.FinishReason.Name(response.finish_reason)}]", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    return 0
