-- Shared prelude of every idem script (the Rust side puts it between the shebang line and
-- each script body).
--
-- The owner check (header present, valid, not expired, in flight, same token) is written
-- out in complete.lua, fail.lua, extend.lua and journal_put.lua rather than shared here on
-- purpose: this prelude is re-run on every call, and each function it defines costs Redis
-- CPU per script call (measured ~0.45 us), on the path whose cost decides throughput. Keep
-- the four copies identical; the conformance fencing scenarios check each of them.
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
local TWO16 = 65536
local TWO32 = 4294967296
local TWO53 = 9007199254740992
local U32_MAX = 4294967295
local I64_MAX_HI = 2147483647
-- The largest clock reading (ms) a first token is taken from: 2^47 - 1, so that the token,
-- ms << 16, fits in an i64 (FencingToken::first_at).
local FIRST_MS_MAX = 140737488355327
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
