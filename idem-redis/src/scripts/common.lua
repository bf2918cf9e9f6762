-- Shared prelude of every idem script (the Rust side puts it between the shebang line and
-- each script body).
--
-- Record layout: one hash per record at KEYS[1] = <prefix>{<record id hex>}, with the fields
-- listed in FIELDS. Every integer (token, timestamps in ms since the Unix epoch) is kept as
-- a canonical decimal string and handled as one: Lua numbers are doubles and lose precision
-- past 2^53, while tokens and timestamps are 64-bit and saturate like the Rust model.

-- Needs Redis 7 (or Valkey 7.2): the shebang line carries script flags, and scripts
-- replicate their effects, so reading TIME before a write is allowed.

local FIELDS = {
  'v', 'state', 'token', 'fingerprint', 'principal', 'endpoint', 'key',
  'created_at', 'started_at', 'lease_expires_at', 'expires_at', 'response',
}
local FORMAT = '1'
local I64_MAX = '9223372036854775807'
local U64_MAX = '18446744073709551615'

-- A canonical non-negative decimal: digits only, no leading zero, at most 20 digits.
local function is_uint(s)
  return type(s) == 'string' and #s <= 20 and (s == '0' or string.find(s, '^[1-9]%d*$') ~= nil)
end

-- Compares two canonical decimals: -1, 0 or 1.
local function cmp(a, b)
  if #a ~= #b then
    if #a < #b then return -1 end
    return 1
  end
  if a == b then return 0 end
  if a < b then return -1 end
  return 1
end

-- a + b, saturating at max (all canonical decimals).
local function add(a, b, max)
  -- Fast path: both below 10^15, so the sum is below 2^53 and a double holds it exactly.
  if #a <= 15 and #b <= 15 then
    return string.format('%.0f', tonumber(a) + tonumber(b))
  end
  local out = {}
  local carry = 0
  local i, j = #a, #b
  while i > 0 or j > 0 or carry > 0 do
    local d = carry
    if i > 0 then d = d + string.byte(a, i) - 48 end
    if j > 0 then d = d + string.byte(b, j) - 48 end
    if d >= 10 then
      out[#out + 1] = string.char(38 + d)
      carry = 1
    else
      out[#out + 1] = string.char(48 + d)
      carry = 0
    end
    i = i - 1
    j = j - 1
  end
  local s = string.reverse(table.concat(out))
  if cmp(s, max) > 0 then return max end
  return s
end

-- The store's clock in ms: the override passed by the caller (test clocks only), or the
-- server's TIME, so every application server agrees on lease expiry whatever its own
-- clock says.
local function now_ms(override)
  if override ~= '' then return override end
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end

-- The whole record, in FIELDS order (HMGET gives false for a missing field).
local function read_all(key)
  return redis.call('HMGET', key, unpack(FIELDS))
end

-- a - b for canonical decimals with a >= b.
local function sub(a, b)
  if #a <= 15 then
    return string.format('%.0f', tonumber(a) - tonumber(b))
  end
  local out = {}
  local borrow = 0
  local i, j = #a, #b
  while i > 0 do
    local d = string.byte(a, i) - 48 - borrow
    if j > 0 then d = d - (string.byte(b, j) - 48) end
    if d < 0 then
      d = d + 10
      borrow = 1
    else
      borrow = 0
    end
    out[#out + 1] = string.char(48 + d)
    i = i - 1
    j = j - 1
  end
  local s = string.gsub(string.reverse(table.concat(out)), '^0+', '')
  if s == '' then return '0' end
  return s
end

-- Largest relative TTL PEXPIRE accepts comfortably (Redis refuses now + ttl > 2^63 - 1).
local MAX_TTL = '9000000000000000000'

-- Sets the key's native expiry. The record is logically gone at expires_at (every script
-- checks that itself); the key may outlive it by the configured grace (ms). On the server's
-- clock that is PEXPIREAT expires_at + grace. Under a test clock, whose base may differ
-- from the server's, the key keeps the record's remaining time on that clock, plus grace.
local function expire_at(key, now, override, expires_at, grace)
  if override == '' then
    redis.call('PEXPIREAT', key, add(expires_at, grace, I64_MAX))
  else
    redis.call('PEXPIRE', key, add(sub(expires_at, now), grace, MAX_TTL))
  end
end
