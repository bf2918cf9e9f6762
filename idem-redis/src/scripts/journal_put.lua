-- journal_put: write a journal entry of a record (a resumable handler's step result or
-- intent state), fenced like complete (idem_core::Store::journal_put). Entries are hash
-- fields 'j:<name>' of the record's own hash, so they live and die with the record: a
-- reclaim keeps them, native expiry and a claim that replaces an expired record drop them.
-- KEYS[1] record key
-- ARGV[1] clock override in ms, '' for server TIME
-- ARGV[2] token (big-endian u64), ARGV[3] entry name, ARGV[4] value, ARGV[5] '1' to overwrite
-- Returns {'written', now} | {'exists', now, stored value} | {'lost', now, current token or nil}
--       | {'corrupt', now}
local key = KEYS[1]
local now = now_ms(ARGV[1])
local h = redis.call('HGET', key, 'h')
if not h then
  return {'lost', now}
end
if not valid(h) then
  return {'corrupt', now}
end
if now >= num_at(h, AT_EXPIRES) then
  return {'lost', now}
end
local token = string.sub(h, 3, 10)
if string.byte(h, 2) ~= 1 or token ~= ARGV[2] then
  return {'lost', now, token}
end
local field = 'j:' .. ARGV[3]
if ARGV[5] == '1' then
  redis.call('HSET', key, field, ARGV[4])
elseif redis.call('HSETNX', key, field, ARGV[4]) == 0 then
  return {'exists', now, redis.call('HGET', key, field)}
end
return {'written', now}
