-- extend: renew the caller's lease, compare-and-set on the fencing token
-- (idem_core::Store::extend).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token (big-endian u64), ARGV[3] lease ms (big-endian u64)
-- ARGV[4] expiry grace ms
-- Returns {'ok', now, h as written} | {'lost', now, current token or nil} | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local h = redis.call('HGET', key, 'h')
if not h then
  return {'lost', now}
end
if not valid(h) then
  return {'corrupt', now}
end
if now >= num_at(h, AT_EXPIRES) then
  return {'lost', now}
end
local token = string.sub(h, 3, 10)
if string.byte(h, 2) ~= 1 or token ~= ARGV[2] then
  return {'lost', now, token}
end
-- lease_expires_at = max(lease_expires_at, now + lease), saturating at i64::MAX. A lease
-- that already ran out is renewed too: until someone reclaims it, the holder still owns it.
local nh, nl = split(now)
local lh, ll = struct.unpack('>I4I4', ARGV[3])
local leh, lel = add(nh, nl, lh, ll, I64_MAX_HI)
local oh, ol = struct.unpack('>I4I4', h, AT_LEASE)
if oh > leh or (oh == leh and ol >= lel) then
  -- The lease already ends at or after now + lease: nothing moves, nothing is written.
  return {'ok', now, h}
end
-- expires_at = max(expires_at, lease_expires_at): a renewed claim outlives its retention.
local eh, el = struct.unpack('>I4I4', h, AT_EXPIRES)
local moved = leh > eh or (leh == eh and lel > el)
if moved then
  eh, el = leh, lel
end
h = string.sub(h, 1, AT_LEASE - 1) .. struct.pack('>I4I4I4I4', leh, lel, eh, el)
  .. string.sub(h, AT_EXPIRES + 8)
redis.call('HSET', key, 'h', h)
if moved then
  -- The key's native expiry follows the new expires_at (plus grace, see expire in arith.lua).
  expire(key, now, ARGV[1], eh * TWO32 + el, tonumber(ARGV[4]))
end
return {'ok', now, h}
