"""The router's migration state (router/forwarding/migration.py), without a network: the
bytes each attempt sends, the ids it keeps, and when a broken stream may move."""

from __future__ import annotations

import json

import grpc

from common import llm_protocol
from protos import grpc_service_pb2 as pb
from router.forwarding.migration import Migration
from router.money.billing import Piece

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def client_request() -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="smollm2", id="r7")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(b"\x05\x00\x00\x00hello")
    r.parameters["session_id"].string_param = "s1"
    r.parameters[llm_protocol.RETURN_TOKEN_IDS].bool_param = False  # overridden: merged last
    return r


def piece(ids: list[int], total: int, choice: int | None = None) -> Piece:
    return Piece(final=False, completion_tokens=total, token_ids=tuple(ids), choice=choice)


def test_each_attempt_is_the_clients_request_plus_the_ids_sent() -> None:
    original = client_request()
    m = Migration.of(original.SerializeToString(), limit=2)
    assert m is not None
    first = pb.ModelInferRequest.FromString(m.asked)
    assert first.parameters[llm_protocol.RETURN_TOKEN_IDS].bool_param is True
    assert first.raw_input_contents == original.raw_input_contents
    assert first.parameters["session_id"].string_param == "s1" and first.id == "r7"
    m.observe(piece([5, 6], 2))
    m.observe(piece([], 2))  # a piece with no new token (an empty final)
    m.observe(piece([7], 3))
    resumed = pb.ModelInferRequest.FromString(m.next_request())
    assert json.loads(resumed.parameters[llm_protocol.RESUME_TOKEN_IDS].string_param) == [5, 6, 7]
    assert resumed.inputs == first.inputs and resumed.raw_input_contents == first.raw_input_contents
    assert m.done == 1


def test_a_stream_moves_on_unavailable_only_within_its_limit() -> None:
    m = Migration.of(client_request().SerializeToString(), limit=2)
    assert m is not None
    assert not m.allows(UNAVAILABLE)  # no piece carried ids yet: a plain retry's business
    m.observe(piece([1], 1))
    assert m.allows(UNAVAILABLE)
    assert not m.allows(grpc.StatusCode.INVALID_ARGUMENT)
    assert not m.allows(grpc.StatusCode.DEADLINE_EXCEEDED)
    m.next_request()
    m.next_request()
    assert not m.allows(UNAVAILABLE)  # the limit reached
    assert Migration.of(b"", limit=0) is None  # off


def test_ids_that_do_not_add_up_or_several_choices_never_move() -> None:
    for pieces in ([piece([1, 2], 3)], [piece([1], 1, choice=0)]):
        m = Migration.of(b"", limit=2)
        assert m is not None
        for p in pieces:
            m.observe(p)
        assert not m.allows(UNAVAILABLE)


def test_a_piece_without_ids_leaves_the_stream_unmovable() -> None:
    m = Migration.of(b"", limit=2)
    assert m is not None
    m.observe(Piece(final=False, completion_tokens=4))  # a model that sends no ids
    m.observe(None)
    assert not m.allows(UNAVAILABLE)


def test_a_stream_longer_than_a_resume_holds_is_not_moved() -> None:
    m = Migration.of(b"", limit=2)
    assert m is not None
    top = llm_protocol.MAX_RESUME_TOKEN_IDS
    m.observe(piece(list(range(top)), top))
    assert m.allows(UNAVAILABLE)
    m.observe(piece([1], top + 1))
    assert not m.allows(UNAVAILABLE)
