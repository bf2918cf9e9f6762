-- fail: mark the attempt failed, compare-and-set on the fencing token
-- (idem_core::Store::fail).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token
-- Returns {'ok', now, <FIELDS...>} | {'lost', now, current token or nil} | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'v', 'state', 'token', 'lease_expires_at', 'expires_at')
if not (cur[1] or cur[2] or cur[3] or cur[5]) then
  return {'lost', now}
end
if cur[1] ~= FORMAT or not is_uint(cur[3]) or not is_uint(cur[4]) or not is_uint(cur[5]) then
  return {'corrupt', now}
end
if cmp(now, cur[5]) >= 0 then
  return {'lost', now}
end
if cur[2] ~= 'in_flight' or cur[3] ~= ARGV[2] then
  return {'lost', now, cur[3]}
end
-- The attempt is over: its lease no longer blocks a retry.
local lease_expires_at = cur[4]
if cmp(now, lease_expires_at) < 0 then
  lease_expires_at = now
end
redis.call('HSET', key, 'state', 'failed', 'lease_expires_at', lease_expires_at)
redis.call('HDEL', key, 'response')
return {'ok', now, unpack(read_all(key))}
