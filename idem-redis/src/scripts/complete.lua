-- complete: store the terminal response, compare-and-set on the fencing token
-- (idem_core::Store::complete).
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token, ARGV[3] encoded response
-- Returns {'ok', now, <FIELDS... without response>} | {'lost', now, current token or nil}
--       | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local all = read_all(key)
if not (all[1] or all[2] or all[3] or all[11]) then
  return {'lost', now}
end
if all[1] ~= FORMAT or not is_uint(all[3]) or not is_uint(all[11]) then
  return {'corrupt', now}
end
if cmp(now, all[11]) >= 0 then
  return {'lost', now}
end
if all[2] ~= 'in_flight' or all[3] ~= ARGV[2] then
  return {'lost', now, all[3]}
end
-- All timestamps stay: the key keeps its native expiry.
redis.call('HSET', key, 'state', 'completed', 'response', ARGV[3])
all[2] = 'completed'
-- The caller has the response it just sent; do not ship it back.
all[12] = nil
return {'ok', now, unpack(all)}
