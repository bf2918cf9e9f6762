-- reclaim: compare-and-set takeover of an expired lease or a failed record
-- (idem_core::Store::reclaim).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] expected token, ARGV[3] fingerprint
-- ARGV[4] lease ms, ARGV[5] retention ms (already >= lease), ARGV[6] expiry grace ms
-- Returns {'reclaimed', now, <FIELDS...>} | {'conflict', now, <FIELDS...>} | {'absent', now}
--       | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'v', 'state', 'token', 'fingerprint', 'lease_expires_at', 'expires_at')
if not (cur[1] or cur[2] or cur[3] or cur[6]) then
  return {'absent', now}
end
if cur[1] ~= FORMAT or not is_uint(cur[3]) or not is_uint(cur[5]) or not is_uint(cur[6]) then
  return {'corrupt', now}
end
if cmp(now, cur[6]) >= 0 then
  return {'absent', now}
end
local state = cur[2]
local reclaimable = cur[3] == ARGV[2] and cur[4] == ARGV[3]
  and (state == 'failed' or (state == 'in_flight' and cmp(now, cur[5]) >= 0))
if not reclaimable then
  return {'conflict', now, unpack(read_all(key))}
end
local token = add(cur[3], '1', U64_MAX)
local lease_expires_at = add(now, ARGV[4], I64_MAX)
-- The retention window never moves earlier.
local expires_at = add(now, ARGV[5], I64_MAX)
if cmp(cur[6], expires_at) > 0 then
  expires_at = cur[6]
end
redis.call('HSET', key,
  'state', 'in_flight', 'token', token, 'started_at', now,
  'lease_expires_at', lease_expires_at, 'expires_at', expires_at)
redis.call('HDEL', key, 'response')
expire_at(key, now, ARGV[1], expires_at, ARGV[6])
return {'reclaimed', now, unpack(read_all(key))}
