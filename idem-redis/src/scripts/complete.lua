-- complete: store the terminal response, compare-and-set on the fencing token
-- (idem_core::Store::complete).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token (big-endian u64), ARGV[3] encoded response
-- Returns {'ok', now, h as it was (in flight)} | {'lost', now, current token or nil}
--       | {'corrupt', now}
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
-- All timestamps stay: the key keeps its native expiry.
redis.call('HSET', key, 'h', string.sub(h, 1, 1) .. '\2' .. string.sub(h, 3), 'r', ARGV[3])
-- Wakes the record's waiters (RedisStore::settlements): the id on '<prefix>settled'.
redis.call('PUBLISH', string.sub(key, 1, -67) .. 'settled', string.sub(key, -65, -2))
-- The caller has the response it just sent and knows the state is now completed.
return {'ok', now, h}
