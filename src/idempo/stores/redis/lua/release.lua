-- KEYS[1] record. ARGV: the name of the field to match ('tok' or 'n') and its value. Deletes
-- an in-progress record held with that token (release), or reserved with that nonce (the
-- undo of a reserve whose caller never heard the answer). A repeat finds nothing to delete:
-- tokens and nonces are never reused. A record with a recovery point is never deleted: the
-- steps it names committed, and its lease ends on its own.
local r = redis.pcall('HMGET', KEYS[1], ARGV[1], 'st', 'rp')
if not r.err and r[1] == ARGV[2] and r[2] == 'in_progress' and not r[3] then
  return redis.call('DEL', KEYS[1])
end
return 0
