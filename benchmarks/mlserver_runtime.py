"""The smallest fair MLServer runtime for an ONNX model: one onnxruntime session, numpy in
and out through MLServer's own codec. benchmarks/mlserver.py copies this file next to the
model settings (MLServer imports `mlserver_runtime.OnnxRuntime` from its model folder), and
it runs in MLServer's venv, not ours.
"""

from __future__ import annotations

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxRuntime(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        extra = (self.settings.parameters.extra or {}) if self.settings.parameters else {}
        options.intra_op_num_threads = int(extra.get("intra_op_threads", 1))
        options.inter_op_num_threads = 1
        path = await get_model_uri(self.settings, wellknown_filenames=["model.onnx"])
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        results = self.session.run(self.output_names, feeds)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=payload.id,
            outputs=[
                NumpyCodec.encode_output(name, array)
                for name, array in zip(self.output_names, results, strict=True)
            ],
        )
