"""meshserve quantize: real models to ONNX, quantized behind an accuracy gate."""
