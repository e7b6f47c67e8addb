"""protos/ is wire-identical to Triton's: the descriptors equal those tritonclient ships."""

from __future__ import annotations

import pytest
import tritonclient.grpc.model_config_pb2 as triton_mc
import tritonclient.grpc.service_pb2 as triton_service
from google.protobuf import descriptor_pb2

from protos import grpc_service_pb2, model_config_pb2


def _proto(module) -> descriptor_pb2.FileDescriptorProto:  # type: ignore[no-untyped-def]
    fd = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fd)
    return fd


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(grpc_service_pb2, triton_service), (model_config_pb2, triton_mc)],
    ids=["grpc_service", "model_config"],
)
def test_descriptor_matches_triton(ours, theirs) -> None:  # type: ignore[no-untyped-def]
    assert _proto(ours) == _proto(theirs)


def test_both_stub_sets_share_one_pool() -> None:
    # Same file name and content: the protobuf pool holds one copy, so user code may import
    # tritonclient and meshserve together and pass messages between them.
    assert grpc_service_pb2.ModelInferRequest is triton_service.ModelInferRequest


def test_service_methods() -> None:
    ours = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == "inference.GRPCInferenceService"
    for name in [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
    ]:
        assert name in ours.methods_by_name
