"""The rate and spend limits' Lua scripts, run in Redis by router/tenancy/limits.py: one lease of
requests-per-second tokens (LEASE) and one charge of tokens and spend (CHARGE) per call of
them, both refilling the tenant's buckets from Redis's own clock."""

_REFILL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function refill(key, per_us, size)
  local v = redis.call('HMGET', key, 'level', 'at_us')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil or at == nil then return size end
  if now > at then level = math.min(size, level + (now - at) * per_us) end
  return level
end
"""

# KEYS: rps bucket, tpm bucket, spend counter. ARGV: rps, burst, tpm, spend cap, tokens
# wanted, tokens given back (an expired lease's rest).
# -> {1, '', 0, tokens granted (0..wanted)}, or {0, limit, retry after in ms, 0}, or
# {1, 'rps', ms until the next token, granted}: the bucket is empty after these.
LEASE = (
    _REFILL
    + """
local rps, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tpm, cap = tonumber(ARGV[3]), tonumber(ARGV[4])
local want, back = tonumber(ARGV[5]), tonumber(ARGV[6])
local level = 0
if rps > 0 then level = math.min(burst, refill(KEYS[1], rps / 1e6, burst) + back) end
local verdict = nil
if cap > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= cap then
  verdict = {0, 'spend', 0, 0}
elseif tpm > 0 then
  local tokens = refill(KEYS[2], tpm / 60e6, tpm)
  if tokens <= 0 then verdict = {0, 'tpm', math.ceil((1 - tokens) / (tpm / 60e6) / 1000), 0} end
end
local granted = 0
if verdict == nil and rps > 0 and want > 0 then
  granted = math.min(want, math.floor(level))
  if granted < 1 then
    granted = 0
    verdict = {0, 'rps', math.ceil((1 - level) / (rps / 1e6) / 1000), 0}
  elseif level - granted < 1 then
    verdict = {1, 'rps', math.ceil((1 - level + granted) / (rps / 1e6) / 1000), granted}
  end
end
if rps > 0 and (granted > 0 or back > 0) then
  redis.call('HSET', KEYS[1], 'level', tostring(level - granted), 'at_us', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rps * 1000) + 1000)
end
return verdict or {1, '', 0, granted}
"""
)

# KEYS: tpm bucket, spend counter. ARGV: tokens, tpm, micro-USD, the counter's TTL (s),
# spend cap. -> {ms until the tpm bucket is above 0 again (-1: it is), 1 if at the cap}
CHARGE = (
    _REFILL
    + """
local tokens, tpm, spend = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cap = tonumber(ARGV[5])
local wait_ms, over = -1, 0
if tpm > 0 then
  local level = refill(KEYS[1], tpm / 60e6, tpm) - tokens
  if tokens ~= 0 then
    redis.call('HSET', KEYS[1], 'level', tostring(level), 'at_us', now)
    redis.call('PEXPIRE', KEYS[1], 120000)
  end
  if level <= 0 then wait_ms = math.ceil((1 - level) / (tpm / 60e6) / 1000) end
end
local total = 0
if spend ~= 0 then
  total = redis.call('INCRBY', KEYS[2], spend)
  redis.call('EXPIRE', KEYS[2], ARGV[4])
elseif cap > 0 then
  total = tonumber(redis.call('GET', KEYS[2]) or '0')
end
if cap > 0 and total >= cap then over = 1 end
return {wait_ms, over}
"""
)
