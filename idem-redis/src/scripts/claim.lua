-- claim: insert-if-absent (idem_core::Store::claim).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] lease ms and retention ms (already >= lease), two big-endian u64
-- ARGV[3] expiry grace ms, ARGV[4] fingerprint (32 bytes), ARGV[5] scope and key (opaque)
-- Returns {'claimed', now, header} | {'existing', now, header, scope, response or nil}
--       | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'h', 's', 'r')
local h = cur[1]
local th, tl = 0, 1
if h then
  if not valid(h) then
    return {'corrupt', now}
  end
  -- A live record: nothing to write.
  if now < num_at(h, AT_EXPIRES) then
    return {'existing', now, h, cur[2], cur[3]}
  end
  -- Past its retention: counts as absent, but the token keeps growing so a very late owner
  -- of the old record can never complete the new one.
  th, tl = struct.unpack('>I4I4', h, AT_TOKEN)
  th, tl = add(th, tl, 0, 1, U32_MAX)
  redis.call('DEL', key)
elseif cur[2] or cur[3] then
  return {'corrupt', now}
end
local nh, nl, leh, lel, eh, el = deadlines(now, ARGV[2])
local header = struct.pack('>BBI4I4I4I4I4I4I4I4I4I4', FORMAT, 1, th, tl, nh, nl, nh, nl, leh, lel, eh, el) .. ARGV[4]
redis.call('HSET', key, 'h', header, 's', ARGV[5])
expire(key, now, ARGV[1], eh * TWO32 + el, tonumber(ARGV[3]))
return {'claimed', now, header}
