"""meshserve worker: serves ONNX models over the KServe v2 gRPC API with dynamic batching."""
