"""What the router reads of a worker's response to bill it, and the per-token arithmetic."""

from __future__ import annotations

from common.mesh_state import ModelEntry
from protos import grpc_service_pb2 as pb
from router.accounting import Receipt, Tokens, Usage, token_revenue
from router.billing import Piece, TokenMeter, stream_piece, unary_piece

ENTRY = ModelEntry(["1"], 8, 0, 0, 50, 200)


def piece(final: bool | None, prompt: int, completion: int, reason: str = "") -> bytes:
    r = pb.ModelInferResponse(model_name="m", id="7")
    r.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    r.raw_output_contents.append(b"\x03\x00\x00\x00abc")
    if final is not None:
        r.parameters["triton_final_response"].bool_param = final
    r.parameters["prompt_tokens"].int64_param = prompt
    r.parameters["completion_tokens"].int64_param = completion
    if reason:
        r.parameters["finish_reason"].string_param = reason
    return pb.ModelStreamInferResponse(infer_response=r).SerializeToString()


def test_pieces_parse_without_the_tensors() -> None:
    assert stream_piece(piece(False, 5, 3)) == Piece(False, "", 5, 3, None)
    assert stream_piece(piece(True, 5, 9, "length")) == Piece(True, "", 5, 9, "length")
    assert stream_piece(piece(None, 5, 9)).final  # a model that is not decoupled: one response
    error = pb.ModelStreamInferResponse(error_message="boom").SerializeToString()
    assert stream_piece(error) == Piece(True, "boom")
    unary = pb.ModelInferResponse.FromString(
        pb.ModelStreamInferResponse.FromString(
            piece(True, 4, 2, "stop")
        ).infer_response.SerializeToString()
    )
    assert unary_piece(unary.SerializeToString()).completion_tokens == 2


def test_a_stream_billed_piece_by_piece_costs_exactly_the_whole_call() -> None:
    """ceil((p x 50 + c x 200) / 1000) per call, however the pieces split it."""
    meter = TokenMeter.of(ENTRY)
    deltas = [meter.advance(Piece(False, "", 7, c)) for c in (1, 2, 2, 5, 6)]
    deltas.append(meter.advance(Piece(True, "", 7, 9, "stop")))
    assert sum(d.prompt for d in deltas) == 7 and sum(d.completion for d in deltas) == 9
    assert sum(d.revenue_micro_usd for d in deltas) == token_revenue(7, 9, 50, 200) == 3
    assert deltas[2] == Tokens(0, 0, 0)  # no new tokens: nothing billed
    meter.take_back(deltas[-1])  # the final piece did not go out
    assert (meter.completion, meter.revenue) == (6, token_revenue(7, 6, 50, 200))


def test_a_refunded_piece_and_a_refunded_call() -> None:
    u = Usage()
    u.add(True, 200, 10, Tokens(7, 9, 3), "stop")
    u.refund(Receipt("m", "1", 200, Tokens(0, 3, 1), "stop"))
    assert (u.success, u.errors, u.revenue_micro_usd, u.finished_stop) == (0, 1, 0, 0)
    assert (u.prompt_tokens, u.completion_tokens, u.token_revenue_micro_usd) == (7, 6, 2)
    u.refund(Receipt("m", "1", 0, Tokens(0, 1, 1), call=False))  # one piece only
    assert (u.calls, u.errors, u.completion_tokens) == (1, 1, 5)
