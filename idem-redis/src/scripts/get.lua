-- get: read a record, treating one past expires_at as absent even before Redis expires
-- the key (idem_core::Store::get). Read-only.
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- Returns {'found', now, <FIELDS...>} | {'absent', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local all = read_all(key)
local expires_at = all[11]
if not (all[1] or all[2] or all[3] or expires_at) then
  return {'absent', now}
end
if is_uint(expires_at) and cmp(now, expires_at) >= 0 then
  return {'absent', now}
end
return {'found', now, unpack(all)}
