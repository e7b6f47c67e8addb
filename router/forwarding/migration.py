"""Mid-stream migration: a stream whose worker dies goes on on another replica.

As NVIDIA Dynamo's Migration operator does, the router keeps, for each streamed request, the
ids of the tokens its client was sent, and when the worker's stream breaks (UNAVAILABLE: the
worker died, its connection reset, or the registry abandoned it as stalled or gone) it
re-issues the request to another replica with those ids; the client's stream goes on with
the next piece, nothing repeated, nothing missing. Unlike Dynamo, which sends the prompt
plus the ids as a new prompt with the remaining max_tokens (re-prefilled in one run), the
ids travel as their own parameter (common/llm_protocol.py):

- the first attempt asks the worker for each piece's ids (`return_token_ids`);
- a migration sends the same request bytes with `resume_token_ids`: the worker prefills the
  prompt, then takes the ids in place of its first samples, decoding them one a step as the
  first worker did. A one-token run rounds differently from a longer one on onnxruntime's
  CPU kernels (worker/llm/scheduler.py, MIN_CHUNK), so a re-prefill would give other keys
  and values and, within tens of tokens, another greedy text; decoding them gives the
  uninterrupted run's, for the price of one decode row a step per id. Its detokenizer
  starts where the text sent stopped (mid-character, mid-stop-string), its seeded sampler
  draws as it did, and its pieces carry the uninterrupted run's counts, so the request's
  meter (router/money/billing.py), which bills only what grows, bills the prompt once and
  each token once: the ids decoded again are the new worker's cost, not the client's.

Both are appended to the client's bytes as a serialized request header holding only those
parameters: protobuf merges a message's fields on parse (a map entry appended last wins), so
the request is never decoded here.

A request migrates at most `limit` times, only on UNAVAILABLE, only when another replica is
left, and only while its pieces carry ids that add up to their running completion_tokens
(an LLM with a single choice: a model that sends no ids, or n > 1, ends with the error) and
number at most MAX_RESUME_TOKEN_IDS (what a stream holds here: 4 bytes a token).
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field

import grpc

from common import llm_protocol
from protos.routing_pb2 import InferHeader
from router.money.billing import Piece

DEFAULT_LIMIT = 2


def _with_parameters(raw: bytes, **values: bool | str) -> bytes:
    """`raw` (a serialized ModelInferRequest) with these request parameters set (InferHeader
    numbers its parameters map as ModelInferRequest does)."""
    extra = InferHeader()
    for name, value in values.items():
        if isinstance(value, bool):
            extra.parameters[name].bool_param = value
        else:
            extra.parameters[name].string_param = value
    return raw + extra.SerializeToString()


@dataclass(eq=False)
class Migration:
    """One streamed request's migration state: the bytes its attempts send and the ids its
    client was sent."""

    asked: bytes  # the client's request, asking for each piece's token ids
    limit: int
    ids: array = field(default_factory=lambda: array("i"))  # 4 bytes a token
    done: int = 0  # migrations so far
    resumable: bool = False  # a piece carried ids: an LLM stream that can resume
    broken: bool = False  # ids that do not add up, or several choices: cannot resume exactly

    @classmethod
    def of(cls, raw: bytes, limit: int) -> Migration | None:
        """The state of a streamed request; None when migration is off (`limit` 0)."""
        if limit <= 0:
            return None
        return cls(_with_parameters(raw, **{llm_protocol.RETURN_TOKEN_IDS: True}), limit)

    def observe(self, piece: Piece | None) -> None:
        """A piece forwarded to the client: its ids join those sent."""
        if piece is None or piece.token_ids is None:
            return
        self.resumable = True
        self.ids.extend(piece.token_ids)
        total = piece.completion_tokens
        if piece.choice is not None or (total is not None and total != len(self.ids)):
            self.broken = True

    def allows(self, code: grpc.StatusCode) -> bool:
        """Whether a failure with `code` may move the request to another replica."""
        return (
            code == grpc.StatusCode.UNAVAILABLE
            and self.resumable
            and not self.broken
            and self.done < self.limit
            and len(self.ids) <= llm_protocol.MAX_RESUME_TOKEN_IDS
        )

    def next_request(self) -> bytes:
        """The bytes of the next attempt: the request resumed from the ids sent (counted)."""
        self.done += 1
        if not self.ids:
            return self.asked
        ids = json.dumps(self.ids.tolist(), separators=(",", ":"))
        return _with_parameters(self.asked, **{llm_protocol.RESUME_TOKEN_IDS: ids})
