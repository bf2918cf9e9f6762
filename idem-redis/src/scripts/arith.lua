-- 64-bit arithmetic and native expiry, for reclaim and fail (claim writes out its own).
-- Kept out of common.lua because every helper defined here is a closure the server builds
-- again on each call.

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
