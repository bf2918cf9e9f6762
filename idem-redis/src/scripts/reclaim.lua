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
local all = read_all(key)
if not (all[1] or all[2] or all[3] or all[11]) then
  return {'absent', now}
end
if all[1] ~= FORMAT or not is_uint(all[3]) or not is_uint(all[10]) or not is_uint(all[11]) then
  return {'corrupt', now}
end
if cmp(now, all[11]) >= 0 then
  return {'absent', now}
end
local state = all[2]
local reclaimable = all[3] == ARGV[2] and all[4] == ARGV[3]
  and (state == 'failed' or (state == 'in_flight' and cmp(now, all[10]) >= 0))
if not reclaimable then
  return {'conflict', now, unpack(all)}
end
local token = add(all[3], '1', U64_MAX)
local lease_expires_at = add(now, ARGV[4], I64_MAX)
-- The retention window never moves earlier.
local expires_at = add(now, ARGV[5], I64_MAX)
if cmp(all[11], expires_at) > 0 then
  expires_at = all[11]
end
redis.call('HSET', key,
  'state', 'in_flight', 'token', token, 'started_at', now,
  'lease_expires_at', lease_expires_at, 'expires_at', expires_at)
if all[12] then
  redis.call('HDEL', key, 'response')
  all[12] = false
end
expire_at(key, now, ARGV[1], expires_at, ARGV[6])
all[2], all[3], all[9], all[10], all[11] = 'in_flight', token, now, lease_expires_at, expires_at
return {'reclaimed', now, unpack(all)}
