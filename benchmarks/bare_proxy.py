"""The floor for any Python gRPC router: grpc.aio passing ModelInfer bytes to its upstreams
(gRPC's own round robin), with no balancing policy, accounting, metrics or failover.

    python benchmarks/bare_proxy.py UPSTREAM[,UPSTREAM...] PORT [--uvloop]
"""

from __future__ import annotations

import asyncio
import sys

import grpc

METHOD = "/inference.GRPCInferenceService/ModelInfer"


async def main(upstream: str, port: int) -> None:
    channel = grpc.aio.insecure_channel(
        "ipv4:" + upstream, options=[("grpc.lb_policy_name", "round_robin")]
    )
    infer = channel.unary_unary(METHOD)

    async def model_infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await infer(request, timeout=30)  # type: ignore[no-any-return]

    async def server_ready(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"\x08\x01"  # ServerReadyResponse(ready=True)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService",
                {
                    "ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer),
                    "ServerReady": grpc.unary_unary_rpc_method_handler(server_ready),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    if "--uvloop" in sys.argv[3:]:
        import uvloop

        uvloop.run(main(sys.argv[1], int(sys.argv[2])))
    else:
        asyncio.run(main(sys.argv[1], int(sys.argv[2])))
