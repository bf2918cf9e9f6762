-- complete: store the terminal response, compare-and-set on the fencing token
-- (idem_core::Store::complete).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token, ARGV[3] encoded response
-- Returns {'ok', now, <FIELDS... without response>} | {'lost', now, current token or nil}
--       | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'v', 'state', 'token', 'expires_at')
if not (cur[1] or cur[2] or cur[3] or cur[4]) then
  return {'lost', now}
end
if cur[1] ~= FORMAT or not is_uint(cur[3]) or not is_uint(cur[4]) then
  return {'corrupt', now}
end
if cmp(now, cur[4]) >= 0 then
  return {'lost', now}
end
if cur[2] ~= 'in_flight' or cur[3] ~= ARGV[2] then
  return {'lost', now, cur[3]}
end
-- All timestamps stay: the key keeps its native expiry.
redis.call('HSET', key, 'state', 'completed', 'response', ARGV[3])
local all = read_all(key)
-- The caller has the response it just sent; do not ship it back.
all[#all] = nil
return {'ok', now, unpack(all)}
