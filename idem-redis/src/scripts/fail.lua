-- fail: mark the attempt failed, compare-and-set on the fencing token
-- (idem_core::Store::fail).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token (big-endian u64)
-- Returns {'ok', now, h} | {'lost', now, current token or nil} | {'corrupt', now}
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
-- The attempt is over: its lease no longer blocks a retry. (An in-flight record has no
-- response field: claim writes a fresh hash and reclaim only takes failed or in-flight ones.)
local lease = string.sub(h, AT_LEASE, AT_LEASE + 7)
if now < num_at(h, AT_LEASE) then
  lease = struct.pack('>I4I4', split(now))
end
h = string.sub(h, 1, 1) .. '\3' .. string.sub(h, 3, AT_LEASE - 1) .. lease .. string.sub(h, AT_EXPIRES)
redis.call('HSET', key, 'h', h)
-- Wakes the record's waiters (RedisStore::settlements): the id on '<prefix>settled'.
redis.call('PUBLISH', string.sub(key, 1, -67) .. 'settled', string.sub(key, -65, -2))
return {'ok', now, h}
