-- claim: insert-if-absent (idem_core::Store::claim).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] lease ms, ARGV[3] retention ms (already >= lease), ARGV[4] expiry grace ms
-- ARGV[5] fingerprint (32 bytes), ARGV[6] principal, ARGV[7] endpoint, ARGV[8] idempotency key
-- Returns {'claimed', now, token, lease_expires_at, expires_at}
--       | {'existing', now, <FIELDS...>}
--       | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'v', 'token', 'expires_at')
local token = '1'
if cur[1] or cur[2] or cur[3] then
  if cur[1] ~= FORMAT or not is_uint(cur[2]) or not is_uint(cur[3]) then
    return {'corrupt', now}
  end
  if cmp(now, cur[3]) < 0 then
    return {'existing', now, unpack(read_all(key))}
  end
  -- Past its retention: counts as absent, but the token keeps growing so a very late owner
  -- of the old record can never complete the new one.
  token = add(cur[2], '1', U64_MAX)
  redis.call('DEL', key)
end
local lease_expires_at = add(now, ARGV[2], I64_MAX)
local expires_at = add(now, ARGV[3], I64_MAX)
redis.call('HSET', key,
  'v', FORMAT, 'state', 'in_flight', 'token', token, 'fingerprint', ARGV[5],
  'principal', ARGV[6], 'endpoint', ARGV[7], 'key', ARGV[8],
  'created_at', now, 'started_at', now, 'lease_expires_at', lease_expires_at, 'expires_at', expires_at)
expire_at(key, now, ARGV[1], expires_at, ARGV[4])
return {'claimed', now, token, lease_expires_at, expires_at}
