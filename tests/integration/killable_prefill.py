"""A prefill service in a process of its own, for tests that SIGKILL it mid-call: its Submit
holds each prompt ``--hold-s`` seconds, then answers with a first token that ends the request
(max_tokens reached at prefill), so no decode service is needed. A test double of prefill_svc
for the router's side of a kill: the real prefill_svc takes seconds to start, and these tests
kill and restart it many times (the live kill tests run the real one).

    python -m tests.integration.killable_prefill --port P --hold-s 0.5
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from tandem.rpc.channels import bind, new_server
from tandem.rpc.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc


class HoldingPrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s

    async def Submit(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillReply:
        await asyncio.sleep(self.hold_s)
        return prefill_pb2.PrefillReply(request_id=request.request_id,
                                        first_token=common_pb2.GeneratedToken(token_id=42),
                                        finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async def Cancel(self, request: prefill_pb2.CancelRequest, context: Any) -> prefill_pb2.CancelReply:
        return prefill_pb2.CancelReply(found=False)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hold-s", type=float, default=0.5)
    args = parser.parse_args()
    server = new_server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(HoldingPrefill(args.hold_s), server)
    bind(server, f"127.0.0.1:{args.port}")
    await server.start()
    print("listening", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
