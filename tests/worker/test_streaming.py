"""worker/streaming.serve, the worker's ModelStreamInfer: each request's replies are written
as they come, but its final reply only once the request is done (its statistics recorded),
so a client that holds the final reply finds the request counted. A request that fails
gets its error on a stream that goes on serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from common.errors import InvalidArgument
from common.llm_protocol import FINAL_RESPONSE
from protos import grpc_service_pb2 as pb
from worker import streaming


def piece(reply_id: str, final: bool) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(id=reply_id)
    response.parameters[FINAL_RESPONSE].bool_param = final
    return response


async def requests(*ids: str) -> AsyncIterator[pb.ModelInferRequest]:
    for request_id in ids:
        yield pb.ModelInferRequest(id=request_id)


def test_the_final_reply_is_written_once_its_request_is_done() -> None:
    done: list[str] = []
    written: list[tuple[str, bool]] = []  # (reply id, its request done when written)

    async def handle(request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferResponse]:
        try:
            for i in range(3):
                yield piece(f"{request.id}.{i}", final=i == 2)
                await asyncio.sleep(0)
        finally:
            done.append(request.id)  # the servicer records statistics here

    async def write(reply: pb.ModelStreamInferResponse) -> None:
        reply_id = reply.infer_response.id
        written.append((reply_id, reply_id.split(".")[0] in done))
        await asyncio.sleep(0)

    asyncio.run(streaming.serve(requests("a", "b"), handle, write, streams=True))
    assert sorted(written) == [
        ("a.0", False),
        ("a.1", False),
        ("a.2", True),
        ("b.0", False),
        ("b.1", False),
        ("b.2", True),
    ]
    # each request's replies in order
    assert [r for r, _ in written if r.startswith("a")] == ["a.0", "a.1", "a.2"]


def test_a_failed_request_gets_its_error_after_its_pieces_and_the_stream_serves_on() -> None:
    written: list[pb.ModelStreamInferResponse] = []

    async def handle(request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferResponse]:
        yield piece(f"{request.id}.0", final=False)
        if request.id == "bad":
            raise InvalidArgument("input 'text_input': one string expected, got 2 elements")
        yield piece(f"{request.id}.1", final=True)

    async def write(reply: pb.ModelStreamInferResponse) -> None:
        written.append(reply)

    asyncio.run(streaming.serve(requests("bad", "good"), handle, write, streams=True))
    bad = [r for r in written if r.infer_response.id.startswith("bad")]
    assert [r.infer_response.id for r in bad] == ["bad.0", "bad"]
    assert bad[0].error_message == ""
    assert bad[1].error_message == "input 'text_input': one string expected, got 2 elements"
    good = [r.infer_response.id for r in written if r.infer_response.id.startswith("good")]
    assert good == ["good.0", "good.1"]
