-- journal_get: read a journal entry; none when the record is absent or past expires_at
-- (idem_core::Store::journal_get). Read-only.
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] entry name
-- Returns {'found', now, value} | {'absent', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local cur = redis.call('HMGET', key, 'h', 'j:' .. ARGV[2])
local h = cur[1]
if not h or not valid(h) or now >= num_at(h, AT_EXPIRES) or not cur[2] then
  return {'absent', now}
end
return {'found', now, cur[2]}
