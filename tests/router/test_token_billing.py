"""What the router reads of a worker's response to bill it, and the per-token arithmetic."""

from __future__ import annotations

from common.mesh_state import ModelEntry
from protos import grpc_service_pb2 as pb
from router.money.accounting import Receipt, Tokens, Usage, token_revenue
from router.money.billing import Piece, TokenMeter, stream_piece, unary_piece

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


def test_cached_prompt_tokens_are_billed_once_at_their_price() -> None:
    """30 prompt tokens of which 20 came from the prefix cache, at 10 instead of 50 per 1k:
    the pieces of the stream add up to the price of the whole call, and the discount to the
    difference from the input price; a piece taken back takes back its share."""
    entry = ModelEntry(["1"], 8, 0, 0, 50, 200, 10)
    assert (
        entry.cached_input_price == 10
        and ModelEntry(["1"], 8, 0, 0, 50, 200).cached_input_price == 50
    )
    meter = TokenMeter.of(entry)
    deltas = [meter.advance(Piece(False, "", 30, c, None, 20)) for c in (1, 4)]
    deltas.append(meter.advance(Piece(True, "", 30, 9, "stop", 20)))
    exact = token_revenue(30, 9, 50, 200, 20, 10)
    assert exact == -(-(10 * 50 + 20 * 10 + 9 * 200) // 1000) == 3
    assert sum(d.revenue_micro_usd for d in deltas) == exact
    assert sum(d.cached for d in deltas) == 20  # billed once, on the first piece
    full = token_revenue(30, 9, 50, 200)
    assert sum(d.discount_micro_usd for d in deltas) == full - exact
    meter.take_back(deltas[0])
    assert (meter.cached, meter.prompt, meter.revenue) == (
        0,
        0,
        exact - deltas[0].revenue_micro_usd,
    )
    # a worker claiming more cached tokens than the prompt is capped at the prompt
    capped = TokenMeter.of(entry).advance(Piece(True, "", 5, 1, "stop", 99))
    assert capped.cached == 5
    u = Usage()
    u.add(True, 0, 1, Tokens(30, 9, 3, 20, 1), "stop")
    assert (u.cached_tokens, u.cached_discount_micro_usd) == (20, 1)
    u.refund(Receipt("m", "1", 0, Tokens(30, 9, 3, 20, 1), "stop"))
    assert (u.cached_tokens, u.cached_discount_micro_usd) == (0, 0)


def test_cached_tokens_parse_from_a_piece() -> None:
    raw = pb.ModelStreamInferResponse.FromString(piece(True, 5, 9, "stop"))
    raw.infer_response.parameters["cached_tokens"].int64_param = 4
    assert stream_piece(raw.SerializeToString()).cached_tokens == 4
    assert stream_piece(piece(True, 5, 9, "stop")).cached_tokens is None
