-- What every script starts with (the loader prepends this file): the record's layout.
--
-- A record is one string: a 59-byte header, then the fingerprint, the recovery point, the
-- principal, the operation, the key and, once settled, the response (the rest of the value).
-- The header, big-endian (struct.unpack numbers from 1):
--    1 state      'i' in progress, 'c' completed, 'f' failed, 'x' a released or evicted record
--                 (its token is the floor of the next one)
--    2 clock      'r' Redis's, 'g' a clock the caller gave, 'd' Redis's, with the times
--                 derived from the key's own expiry (the fresh reservation, a plain SET)
--    3 token
--    4-7 created, updated, lease end, retention end (µs since the epoch); 'd': 0, 0, the
--                 lease and the key's PX (µs), from which derive() makes them absolute
--    8 nonce      8 bytes, the reservation's own
--    9-13 lengths of the fingerprint (+32768: 64 hex digits stored as 32 bytes), the point
--                 (+1; 0 for none), the principal, the operation, the key
-- _protocol.py writes the same layout; docs/stores.md describes it.
local HEADER = '>c1c1i8i8i8i8i8c8HHHHB'
local NO_NONCE = '\0\0\0\0\0\0\0\0'
local NO_STRINGS = '\0\0\0\0\0\0\0\0\0'

local function clock(given)
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end

-- The PX of a record kept until ``untl``. On Redis's clock the key expires exactly when the
-- retention ends (a key Redis still holds is inside its retention: a replay needs no clock);
-- on a given clock, that long after ``now`` plus the grace.
local function px(untl, now, given, grace)
  local ms
  if given then ms = math.ceil((untl - now) / 1000) + grace else ms = math.floor((untl - now) / 1000) end
  if ms < 1 then ms = 1 end
  return string.format('%d', ms)
end
