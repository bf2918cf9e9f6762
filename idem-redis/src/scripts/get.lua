-- get: read a record, treating one past expires_at as absent even before Redis expires
-- the key (idem_core::Store::get). Read-only.
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- Returns {'found', now, h or nil, response or nil} | {'absent', now}
-- (an unreadable header comes back as found, for the caller to report as corrupt)
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'h', 'r')
local h = cur[1]
if not (h or cur[2]) then
  return {'absent', now}
end
if h and valid(h) and now >= num_at(h, AT_EXPIRES) then
  return {'absent', now}
end
return {'found', now, h, cur[2]}
