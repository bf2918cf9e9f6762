-- fail: mark the attempt failed, compare-and-set on the fencing token
-- (idem_core::Store::fail).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token
-- Returns {'ok', now, <FIELDS...>} | {'lost', now, current token or nil} | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local all = read_all(key)
if not (all[1] or all[2] or all[3] or all[11]) then
  return {'lost', now}
end
if all[1] ~= FORMAT or not is_uint(all[3]) or not is_uint(all[10]) or not is_uint(all[11]) then
  return {'corrupt', now}
end
if cmp(now, all[11]) >= 0 then
  return {'lost', now}
end
if all[2] ~= 'in_flight' or all[3] ~= ARGV[2] then
  return {'lost', now, all[3]}
end
-- The attempt is over: its lease no longer blocks a retry.
if cmp(now, all[10]) < 0 then
  all[10] = now
end
redis.call('HSET', key, 'state', 'failed', 'lease_expires_at', all[10])
if all[12] then
  redis.call('HDEL', key, 'response')
  all[12] = false
end
all[2] = 'failed'
return {'ok', now, unpack(all)}
