-- journal_put: write a journal entry of a record (a resumable handler's step result or
-- intent state), fenced like complete (idem_core::Store::journal_put). Entries are hash
-- fields 'j:<name>' of the record's own hash, so they live and die with the record: a
-- reclaim keeps them, native expiry and a claim that replaces an expired record drop them.
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token, ARGV[3] entry name, ARGV[4] value, ARGV[5] '1' to overwrite
-- Returns {'written', now} | {'exists', now, stored value} | {'lost', now, current token or nil}
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
local field = 'j:' .. ARGV[3]
if ARGV[5] ~= '1' then
  local stored = redis.call('HGET', key, field)
  if stored then
    return {'exists', now, stored}
  end
end
redis.call('HSET', key, field, ARGV[4])
return {'written', now}
