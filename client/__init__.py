"""A thin KServe v2 gRPC client: numpy arrays or text in, numpy arrays or text out.

    from client import Client
    with Client("127.0.0.1:8001") as c:
        print(c.infer("mlp", {"INPUT0": np.ones((1, 16), np.float32)}).outputs["OUTPUT0"])

Works against meshserve's worker and router, Triton and MLServer (the same protocol).
"""

from client.client import AsyncClient, Client
from client.codec import InferResult, ModelMetadata, ServerMetadata, TensorMetadata

__all__ = [
    "AsyncClient",
    "Client",
    "InferResult",
    "ModelMetadata",
    "ServerMetadata",
    "TensorMetadata",
]
