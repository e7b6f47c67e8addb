"""The floor to compare the worker with: a bare grpc.aio ModelInfer over one onnxruntime
session, run inline on the event loop. No validation, batching, statistics or health.

    python benchmarks/bare_server.py MODEL.onnx PORT
"""

from __future__ import annotations

import asyncio
import sys

import grpc
import numpy as np
import onnxruntime as ort

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc


class Bare(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, path: str) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    async def ServerReady(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ServerReadyResponse(ready=True)

    async def ModelInfer(self, request, context):  # type: ignore[no-untyped-def]
        t = request.inputs[0]
        x = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(tuple(t.shape))
        (y,) = self.session.run(None, {t.name: x})
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="OUTPUT0", datatype="FP32", shape=y.shape)
        response.raw_output_contents.append(y.tobytes())
        return response


async def main(path: str, port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Bare(path), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
