"""Session affinity's LRU map and the session read from a request's header."""

from __future__ import annotations

from protos import grpc_service_pb2 as pb
from protos.routing_pb2 import InferHeader
from router.forwarding.affinity import MAX_SESSION, Affinity, session_of


def header(**params: object) -> InferHeader:
    request = pb.ModelInferRequest(model_name="smollm2", id="r1")
    for key, value in params.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = str(value)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(b"\x05\x00\x00\x00hello")
    return InferHeader.FromString(request.SerializeToString())


def test_the_header_reads_the_session_from_the_request_parameters_not_the_tensors() -> None:
    h = header(session_id="chat-42", max_tokens=8)
    assert (h.model_name, h.id) == ("smollm2", "r1")
    assert session_of(h.parameters) == "chat-42"
    assert session_of(header(conversation_id=7).parameters) == "7"
    assert session_of(header(max_tokens=8).parameters) is None
    assert session_of(header(session_id=True).parameters) is None  # not an id
    assert session_of(header(session_id="").parameters) is None
    assert session_of(header(session_id="x" * (MAX_SESSION + 1)).parameters) is None


def test_affinity_remembers_per_model_and_forgets_the_least_recent() -> None:
    a = Affinity(max_sessions=2)
    a.remember("m", "s1", "w0")
    a.remember("m", "s2", "w1")
    assert a.get("m", "s1") == "w0"  # s1 is now the most recent
    assert a.get("other", "s1") is None
    a.remember("m", "s3", "w0")  # evicts s2
    assert len(a) == 2 and a.get("m", "s2") is None and a.get("m", "s1") == "w0"
    a.remember("m", "s1", "w1")  # moved
    assert a.get("m", "s1") == "w1"
    assert a.get("m", None) is None


def test_affinity_off() -> None:
    a = Affinity(max_sessions=0)
    a.remember("m", "s1", "w0")
    assert len(a) == 0 and a.get("m", "s1") is None
