-- Shared prelude of every idem script (the Rust side puts it between the shebang line and
-- each script body).
--
-- Record layout (format 2): one hash per record at KEYS[1] = <prefix>{<record id hex>}:
--   'h'        the header, HEADER_LEN bytes, then the scope. Scripts decide on the header:
--                byte 1      format version (FORMAT)
--                byte 2      state: 1 in flight, 2 completed, 3 failed
--                bytes 3-10  fencing token, u64 big-endian
--                bytes 11-18 created_at, 19-26 started_at, 27-34 lease_expires_at,
--                            35-42 expires_at: ms since the Unix epoch, u64 big-endian
--                bytes 43-74 fingerprint
--              and carry the scope (principal, endpoint, idempotency key, encoded by the
--              Rust side) along without parsing it. One field, so most scripts make one read.
--   'r'        the encoded response (completed records only)
--   'j:<name>' journal entries
--
-- Lua numbers are doubles, exact only below 2^53, while tokens and timestamps are 64-bit
-- and saturate like the Rust model. So 64-bit values are read and written as two 32-bit
-- halves (struct 'I4', exact), added half by half, and compared against the clock as a
-- double: the clock reads below 2^53 ms and rounding is monotonic, so `now < x` is exact
-- even when x itself is rounded.

-- Needs Redis 7 (or Valkey 7.2): the shebang line carries script flags, and scripts
-- replicate their effects, so reading TIME before a write is allowed.

local FORMAT = 2
local HEADER_LEN = 74
local TWO32 = 4294967296
local TWO53 = 9007199254740992
local U32_MAX = 4294967295
local I64_MAX_HI = 2147483647
-- Byte offsets (1-based) of the header's 64-bit fields.
local AT_TOKEN, AT_LEASE, AT_EXPIRES = 3, 27, 35

-- The store's clock in ms (a double, exact): the override passed by the caller (test
-- clocks only, below 2^53), or the server's TIME, so every application server agrees on
-- lease expiry whatever its own clock says.
local function now_ms(override)
  if override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Whether h is a header this version of the scripts can read.
local function valid(h)
  return #h >= HEADER_LEN and string.byte(h, 1) == FORMAT
end

-- The u64 at byte pos of h, as a double (exact below 2^53; see above).
local function num_at(h, pos)
  local hi, lo = struct.unpack('>I4I4', h, pos)
  return hi * TWO32 + lo
end

-- The two halves of n (an integer double below 2^53).
local function split(n)
  local hi = math.floor(n / TWO32)
  return hi, n - hi * TWO32
end

-- (ah, al) + (bh, bl), saturating at (mh, U32_MAX).
local function add(ah, al, bh, bl, mh)
  local hi, lo = ah + bh, al + bl
  if lo >= TWO32 then
    lo = lo - TWO32
    hi = hi + 1
  end
  if hi > mh then return mh, U32_MAX end
  return hi, lo
end

-- now + ttl (the first two big-endian u64 of args, lease and retention, in ms), saturating
-- at i64::MAX: the halves of lease_expires_at and expires_at.
local function deadlines(now, args)
  local nh, nl = split(now)
  local lh, ll, rh, rl = struct.unpack('>I4I4I4I4', args)
  local leh, lel = add(nh, nl, lh, ll, I64_MAX_HI)
  local eh, el = add(nh, nl, rh, rl, I64_MAX_HI)
  return nh, nl, leh, lel, eh, el
end

-- Sets the key's native expiry. The record is logically gone at expires_at (every script
-- checks that itself); the key may outlive it by the configured grace (ms). On the server's
-- clock that is PEXPIREAT expires_at + grace. Under a test clock, whose base may differ
-- from the server's, the key keeps the record's remaining time on that clock, plus grace.
-- A deadline past 2^53 ms (the year 287,000) leaves the key without a native expiry.
local function expire(key, now, override, expires_at, grace)
  if override == '' then
    local at = expires_at + grace
    if at < TWO53 then
      redis.call('PEXPIREAT', key, string.format('%.0f', at))
      return
    end
  else
    local ttl = expires_at - now + grace
    if ttl < TWO53 then
      redis.call('PEXPIRE', key, string.format('%.0f', ttl))
      return
    end
  end
  redis.call('PERSIST', key)
end
