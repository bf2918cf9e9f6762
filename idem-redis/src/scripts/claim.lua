-- claim: insert-if-absent (idem_core::Store::claim).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] lease ms and retention ms (already >= lease), two big-endian u64
-- ARGV[3] expiry grace ms, ARGV[4] fingerprint (32 bytes), ARGV[5] scope (opaque)
-- Returns {'claimed', now, h} | {'existing', now, h, response or nil} | {'corrupt', now}
-- The new record's token is FencingToken::first_at(now), or the replaced record's token + 1
-- when that is larger (see idem_core::transition::claim).
--
-- The most frequent script, so its fresh-key path is written out inline rather than
-- through arith.lua's helpers: every helper is a closure the server builds on each call.
-- It reads the record first: a retry of a live record (a replay, a 409) reads one hash and
-- builds nothing.
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'h', 'r')
local old = cur[1]
if old then
  if not valid(old) then
    return {'corrupt', now}
  end
  if now < num_at(old, AT_EXPIRES) then
    return {'existing', now, old, cur[2]}
  end
end
-- now + lease and now + retention, half by half, saturating at i64::MAX (see common.lua).
local nh = math.floor(now / TWO32)
local nl = now - nh * TWO32
local lh, ll, rh, rl = struct.unpack('>I4I4I4I4', ARGV[2])
local leh, lel = nh + lh, nl + ll
if lel >= TWO32 then
  leh, lel = leh + 1, lel - TWO32
end
if leh > I64_MAX_HI then
  leh, lel = I64_MAX_HI, U32_MAX
end
local eh, el = nh + rh, nl + rl
if el >= TWO32 then
  eh, el = eh + 1, el - TWO32
end
if eh > I64_MAX_HI then
  eh, el = I64_MAX_HI, U32_MAX
end
-- The first token of a new generation: FencingToken::first_at(now), now in ms (capped at
-- 2^47 - 1) shifted left by 16 bits, at least 1. As halves: hi = ms / 2^16, lo = the low
-- 16 bits of ms times 2^16, every step exact in a double (ms < 2^47, both halves < 2^32).
local ms = now
if ms > FIRST_MS_MAX then
  ms = FIRST_MS_MAX
end
local fh = math.floor(ms / TWO16)
local fl = (ms - fh * TWO16) * TWO16
if fh == 0 and fl == 0 then
  fl = 1
end
local h = struct.pack('>BBI4I4I4I4I4I4I4I4I4I4', FORMAT, 1, fh, fl, nh, nl, nh, nl, leh, lel, eh, el)
  .. ARGV[4] .. ARGV[5]
if old then
  -- Past its retention: counts as absent, but the token stays above the old record's (its
  -- token + 1, saturating, if that is above first_at(now)), so a very late owner of the
  -- old record can never complete the new one, whatever the clock did meanwhile.
  local th, tl = struct.unpack('>I4I4', old, AT_TOKEN)
  if tl < U32_MAX then
    tl = tl + 1
  elseif th < U32_MAX then
    th, tl = th + 1, 0
  end
  if th > fh or (th == fh and tl > fl) then
    h = string.sub(h, 1, 2) .. struct.pack('>I4I4', th, tl) .. string.sub(h, 11)
  end
  redis.call('DEL', key)
end
-- (A hash without 'h' is not a record; the claim adds its header to it.)
redis.call('HSET', key, 'h', h)
-- Native expiry at expires_at + grace (see expire in arith.lua).
local grace = tonumber(ARGV[3])
local at
if ARGV[1] == '' then
  at = eh * TWO32 + el + grace
  if at < TWO53 then
    redis.call('PEXPIREAT', key, string.format('%.0f', at))
    return {'claimed', now, h}
  end
else
  at = eh * TWO32 + el - now + grace
  if at < TWO53 then
    redis.call('PEXPIRE', key, string.format('%.0f', at))
    return {'claimed', now, h}
  end
end
redis.call('PERSIST', key)
return {'claimed', now, h}
