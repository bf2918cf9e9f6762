-- claim: insert-if-absent (idem_core::Store::claim).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] lease ms and retention ms (already >= lease), two big-endian u64
-- ARGV[3] expiry grace ms, ARGV[4] fingerprint (32 bytes), ARGV[5] scope (opaque)
-- Returns {'claimed', now, h} | {'existing', now, h, response or nil} | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local nh, nl, leh, lel, eh, el = deadlines(now, ARGV[2])
local h = struct.pack('>BBI4I4I4I4I4I4I4I4I4I4', FORMAT, 1, 0, 1, nh, nl, nh, nl, leh, lel, eh, el)
  .. ARGV[4] .. ARGV[5]
-- The common case, a fresh key: one write that fails if any record is there. (A hash
-- without 'h' is not a record; the claim adds its header to it.)
if redis.call('HSETNX', key, 'h', h) == 0 then
  local cur = redis.call('HMGET', key, 'h', 'r')
  local old = cur[1]
  if not valid(old) then
    return {'corrupt', now}
  end
  -- A live record: nothing to write.
  if now < num_at(old, AT_EXPIRES) then
    return {'existing', now, old, cur[2]}
  end
  -- Past its retention: counts as absent, but the token keeps growing so a very late owner
  -- of the old record can never complete the new one.
  local th, tl = struct.unpack('>I4I4', old, AT_TOKEN)
  th, tl = add(th, tl, 0, 1, U32_MAX)
  h = string.sub(h, 1, 2) .. struct.pack('>I4I4', th, tl) .. string.sub(h, 11)
  redis.call('DEL', key)
  redis.call('HSET', key, 'h', h)
end
expire(key, now, ARGV[1], eh * TWO32 + el, tonumber(ARGV[3]))
return {'claimed', now, h}
