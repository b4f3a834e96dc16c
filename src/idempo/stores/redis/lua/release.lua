-- KEYS[1] record. ARGV: 't' and a token, or 'n' and a nonce (8 bytes each, as stored).
-- Releases an in-progress record held with that token (release), or reserved with that
-- nonce (the undo of a reserve whose caller never heard the answer): it becomes a tombstone
-- that keeps the token, so the next reservation's grows past it, until the record's own
-- retention ends. A repeat finds nothing to release: tokens and nonces are never reused.
--
-- A record with a recovery point is never released: the steps it names committed. Its
-- holder ends its lease itself (a checkpoint of lease 0), so a release by token leaves it.
-- Undone by its nonce (a takeover whose caller never learned its token, so never will end
-- that lease), the record and its point stay, its lease ends where it began (the header's
-- updated time: on the record's own clock, whichever it is), and the token grows by one with
-- the nonce cleared: the undone reservation's token is fenced out, and the next attempt
-- takes the record over at once, past it, and resumes from the point. Answers 1 or 0.
local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) ~= 'string' or #v < 59 or string.sub(v, 1, 1) ~= 'i' then return 0 end
local by_nonce = ARGV[1] == 'n'
local at = 3
if by_nonce then at = 43 end
if string.sub(v, at, at + 7) ~= ARGV[2] then return 0 end
if string.sub(v, 53, 54) == '\0\0' then
  redis.call('SET', key, tombstone(v), 'KEEPTTL')
elseif by_nonce then
  -- The header's bytes: 3-10 token, 11-18 created, 19-26 updated, 27-34 lease end,
  -- 35-42 retention end, 43-50 nonce (lua/common.lua).
  local token = struct.unpack('>i8', v, 3)
  redis.call('SET', key, string.sub(v, 1, 2) .. struct.pack('>i8', token + 1)
    .. string.sub(v, 11, 26) .. string.sub(v, 19, 26) .. string.sub(v, 35, 42) .. NO_NONCE
    .. string.sub(v, 51), 'KEEPTTL')
else
  return 0
end
redis.call('PUBLISH', key, '') -- for a duplicate waiting on it (`wait_settled`)
return 1
