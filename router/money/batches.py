"""One router's batches for the durable ledger: their ids (`{epoch}-{seq}`), their payload
(usage per model key), and the script that appends them to the router's stream in Redis
without ever reporting a count as written when it was not (see router/money/accounting.py)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import dataclass, field

from router.money.usage import Usage

# KEYS[1]: the stream, KEYS[2]: the ledger's ack, KEYS[3]: the set of routers the ledger
# drains. ARGV[1]: the id this router appended last ("" before its first append), ARGV[2]:
# this router's id, added to KEYS[3] with its batches, so a router killed right after its
# first append still has that batch drained. Then (id, usage, at_ms) per batch. Returns the
# number of batches now in Redis, or -1 when Redis lost what this router appended last
# (neither in the stream nor acked: a restart without it, an old AOF, a failover to a
# replica that lagged). An id at or below the stream's last one is skipped only when that
# entry is there already (a resend) or the ledger acked it; else the script fails, so no
# count is ever reported as written when it was not.
APPEND = """
local function parse(id)
  local ms, seq = string.match(id, "^(%d+)-(%d+)$")
  if ms == nil then ms, seq = string.match(id, "^(%d+)$"), "1" end
  return tonumber(ms), tonumber(seq)
end
local function le(a_ms, a_seq, b_ms, b_seq)
  return a_ms < b_ms or (a_ms == b_ms and a_seq <= b_seq)
end
local function acked(id)
  local ack = redis.call("GET", KEYS[2])
  if not ack then return false end
  local id_ms, id_seq = parse(id)
  local ack_ms, ack_seq = parse(ack)
  return ack_ms ~= nil and le(id_ms, id_seq, ack_ms, ack_seq)
end
if ARGV[1] ~= "" and #redis.call("XRANGE", KEYS[1], ARGV[1], ARGV[1], "COUNT", 1) == 0
    and not acked(ARGV[1]) then
  return -1
end
redis.call("SADD", KEYS[3], ARGV[2])
for i = 3, #ARGV, 3 do
  local r = redis.pcall("XADD", KEYS[1], ARGV[i], "usage", ARGV[i + 1], "at_ms", ARGV[i + 2])
  if type(r) == "table" and r.err then
    if not string.find(r.err, "equal or smaller") then return redis.error_reply(r.err) end
    local there = redis.call("XRANGE", KEYS[1], ARGV[i], ARGV[i], "COUNT", 1)
    if #there == 0 and not acked(ARGV[i]) then
      return redis.error_reply("BATCHID " .. ARGV[i] .. " is at or below the last id of " ..
        KEYS[1] .. " and is neither there nor acked: is another router using this id?")
    end
  end
end
return (#ARGV - 2) / 3
"""


@dataclass
class Batch:
    seq: int
    usage: dict[str, Usage] = field(default_factory=lambda: defaultdict(Usage))
    at_ms: int = 0
    durable: asyncio.Future | None = None
    epoch: int = 0  # set when the batch closes
    records: int = 0  # calls, pieces and refunds recorded in it
    written: bool = False  # appended once (a Redis that restarted empty gets it again)

    @property
    def id(self) -> tuple[int, int]:
        return (self.epoch, self.seq)

    def args(self) -> list[str]:
        usage = json.dumps({k: u.as_list() for k, u in self.usage.items()})
        return [f"{self.epoch}-{self.seq}", usage, str(self.at_ms)]


def parse_batch_id(text: str) -> tuple[int, int]:
    """ "{epoch}-{seq}" -> (epoch, seq); a bare "{n}" (the ack of a ledger that predates
    epochs, whose ids were "{n}-1") -> (n, 1)."""
    epoch, _, seq = text.partition("-")
    return int(epoch), int(seq or 1)
