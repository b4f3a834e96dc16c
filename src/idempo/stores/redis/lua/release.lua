-- KEYS[1] record. ARGV: 't' and a token, or 'n' and a nonce (8 bytes each, as stored).
-- Releases an in-progress record held with that token (release), or reserved with that
-- nonce (the undo of a reserve whose caller never heard the answer): it becomes a tombstone
-- that keeps the token, so the next reservation's grows past it, until the record's own
-- retention ends. A repeat finds nothing to release: tokens and nonces are never reused. A
-- record with a recovery point is never released: the steps it names committed, and its
-- lease ends on its own. Answers 1 or 0.
local v = redis.pcall('GET', KEYS[1])
if type(v) ~= 'string' or #v < 59 or string.sub(v, 1, 1) ~= 'i' then return 0 end
local at = 3
if ARGV[1] == 'n' then at = 43 end
if string.sub(v, at, at + 7) ~= ARGV[2] or string.sub(v, 53, 54) ~= '\0\0' then return 0 end
redis.call('SET', KEYS[1], tombstone(v), 'KEEPTTL')
redis.call('PUBLISH', KEYS[1], '') -- for a duplicate waiting on it (`wait_settled`)
return 1
