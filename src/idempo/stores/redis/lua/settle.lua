-- KEYS[1] record. ARGV: token, state ('c' or 'f'), response, now ('' for Redis's clock), ttl
-- (µs), grace (ms), and on Redis's clock the caller's estimate of it (µs, never ahead of it:
-- _protocol.TokenClock; '' to read TIME). Answers 0 when the token no longer holds the
-- record, else the end of its retention (µs). Settling again with the same token, state and
-- response succeeds without a change: redis-py re-sending a settle whose reply was lost, or
-- the caller retrying it.
--
-- The hottest script, written for the server's time: each redis.call costs a few µs (more
-- than the command itself), so a fresh reservation's settle runs three (GET, PEXPIRETIME,
-- SET: its time is the caller's estimate, not TIME, and it publishes only when marked), and
-- every string Lua makes costs about as much as a redis.call's share, so the header is read
-- as numbers (string.byte, one struct.unpack) and the new value is one concatenation. An
-- in-progress record holds no response, so everything after its header's times is kept as
-- it is.
local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) ~= 'string' or #v < 59 then return 0 end
local st, clk = string.byte(v, 1, 2)
local tok, ca, ua, _, ea = struct.unpack('>i8i8i8i8i8', v, 3)
if tok ~= tonumber(ARGV[1]) then return 0 end
if st ~= 105 then -- 'i'
  local fpn, rpn, pn, on, kn = struct.unpack('>HHHHB', v, 51)
  local body = 59 + fpn % 32768 + pn + on + kn
  if rpn > 0 then body = body + rpn - 1 end
  if st == string.byte(ARGV[2]) and string.sub(v, body + 1) == ARGV[3] then return 1 end
  return 0
end
-- 'd' (a fresh reservation): its times derive from the key's expiry. Nobody waits for it: a
-- duplicate that waits (`wait_settled`, lua/mark.lua) first makes it a record on Redis's
-- clock ('r'), and the settle of any record but a 'd' one publishes.
local derived = clk == 100
if derived then
  local x = redis.call('PEXPIRETIME', key)
  if x < 0 then return 0 end
  x = x * 1000
  ca = x - ea
  ua = ca
  ea = x
elseif clk ~= 114 and clk ~= 103 then -- neither 'r' nor 'g'
  return 0
end
local given = ARGV[4] ~= ''
local now
if given or ARGV[7] == '' then
  now = clock(ARGV[4])
else
  -- The estimate may lag Redis's clock by the round trip it was read in: a settle is never
  -- stamped before the record's last change on Redis's clock.
  now = tonumber(ARGV[7])
  if clk ~= 103 and now < ua then now = ua end
end
local wanted = now + ARGV[5]
if wanted > ea then ea = wanted end
-- The key's TTL already ends where the retention does, unless the retention grows or the
-- clock changes (a record reserved on one clock and settled on the other). On Redis's clock
-- it is set to expire at the retention's end itself, in the whole ms Redis keeps (the
-- settle's time is an estimate: a PX from it would end elsewhere).
local retime = ea == wanted or (clk == 103) ~= given
local mode = 'r'
if given then mode = 'g' end
local value = ARGV[2] .. mode .. struct.pack('>i8i8i8i8i8', tok, ca, now, 0, ea) .. NO_NONCE
  .. string.sub(v, 51) .. ARGV[3]
if not retime then
  redis.call('SET', key, value, 'KEEPTTL')
elseif given then
  redis.call('SET', key, value, 'PX', px(ea, now, true, ARGV[6]))
else
  redis.call('SET', key, value, 'PXAT', string.format('%d', math.floor(ea / 1000)))
end
-- A duplicate waiting for this record (`wait_settled`) listens on its key's name.
if not derived then redis.call('PUBLISH', key, '') end
return ea
