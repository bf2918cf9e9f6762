-- complete: store the terminal response, compare-and-set on the fencing token
-- (idem_core::Store::complete).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token (big-endian u64), ARGV[3] encoded response
-- Returns {'ok', now, header, scope} | {'lost', now, current token or nil} | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'h', 's')
local h = cur[1]
if not h then
  if cur[2] then return {'corrupt', now} end
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
-- All timestamps stay: the key keeps its native expiry.
h = string.sub(h, 1, 1) .. '\2' .. string.sub(h, 3)
redis.call('HSET', key, 'h', h, 'r', ARGV[3])
-- The caller has the response it just sent; do not ship it back.
return {'ok', now, h, cur[2]}
