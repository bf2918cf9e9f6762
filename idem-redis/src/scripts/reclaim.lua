-- reclaim: compare-and-set takeover of an expired lease or a failed record
-- (idem_core::Store::reclaim).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] expected token (big-endian u64), ARGV[3] fingerprint (32 bytes)
-- ARGV[4] lease ms and retention ms (already >= lease), two big-endian u64
-- ARGV[5] expiry grace ms
-- Returns {'reclaimed', now, h} | {'conflict', now, h, response or nil}
--       | {'absent', now} | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local h = redis.call('HGET', key, 'h')
if not h then
  return {'absent', now}
end
if not valid(h) then
  return {'corrupt', now}
end
if now >= num_at(h, AT_EXPIRES) then
  return {'absent', now}
end
local state = string.byte(h, 2)
local reclaimable = string.sub(h, 3, 10) == ARGV[2] and string.sub(h, 43, 74) == ARGV[3]
  and (state == 3 or (state == 1 and now >= num_at(h, AT_LEASE)))
if not reclaimable then
  if state == 2 then
    return {'conflict', now, h, redis.call('HGET', key, 'r')}
  end
  return {'conflict', now, h}
end
-- Failed and in-flight records have no response field: nothing to drop.
local th, tl = struct.unpack('>I4I4', h, AT_TOKEN)
th, tl = add(th, tl, 0, 1, U32_MAX)
local nh, nl, leh, lel, eh, el = deadlines(now, ARGV[4])
-- The retention window never moves earlier.
local oh, ol = struct.unpack('>I4I4', h, AT_EXPIRES)
if oh > eh or (oh == eh and ol > el) then
  eh, el = oh, ol
end
h = struct.pack('>BBI4I4', FORMAT, 1, th, tl) .. string.sub(h, 11, 18)
  .. struct.pack('>I4I4I4I4I4I4', nh, nl, leh, lel, eh, el) .. string.sub(h, 43)
redis.call('HSET', key, 'h', h)
expire(key, now, ARGV[1], eh * TWO32 + el, tonumber(ARGV[5]))
return {'reclaimed', now, h}
