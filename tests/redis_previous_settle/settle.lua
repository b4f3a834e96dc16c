-- KEYS[1] record. ARGV: token, state ('c' or 'f'), response, now ('' for Redis's clock), ttl
-- (µs), grace (ms). Answers 0 when the token no longer holds the record, else the end of its
-- retention (µs). Settling again with the same token, state and response succeeds without a
-- change: redis-py re-sending a settle whose reply was lost, or the caller retrying it.
--
-- The hottest script, written for the server's instructions: every string Lua makes costs
-- about as much as a redis.call's share, so the header is read as numbers (string.byte,
-- one struct.unpack), and the new value is one concatenation. An in-progress record holds no
-- response, so everything after its header's times is kept as it is.
local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) ~= 'string' or #v < 59 then return 0 end
local st, clk = string.byte(v, 1, 2)
local tok, ca, _, _, ea = struct.unpack('>i8i8i8i8i8', v, 3)
if tok ~= tonumber(ARGV[1]) then return 0 end
if st ~= 105 then -- 'i'
  local fpn, rpn, pn, on, kn = struct.unpack('>HHHHB', v, 51)
  local body = 59 + fpn % 32768 + pn + on + kn
  if rpn > 0 then body = body + rpn - 1 end
  if st == string.byte(ARGV[2]) and string.sub(v, body + 1) == ARGV[3] then return 1 end
  return 0
end
if clk == 100 then -- 'd': the times derive from the key's expiry
  local x = redis.call('PEXPIRETIME', key)
  if x < 0 then return 0 end
  x = x * 1000
  ca = x - ea
  ea = x
elseif clk ~= 114 and clk ~= 103 then -- neither 'r' nor 'g'
  return 0
end
local given = ARGV[4] ~= ''
local now = clock(ARGV[4])
local wanted = now + ARGV[5]
local grows = wanted > ea
if grows then ea = wanted end
local mode = 'r'
if given then mode = 'g' end
local value = ARGV[2] .. mode .. struct.pack('>i8i8i8i8i8', tok, ca, now, 0, ea) .. NO_NONCE
  .. string.sub(v, 51) .. ARGV[3]
-- The key's TTL already ends where the retention does, unless the retention grows or the
-- clock changes (a record reserved on one clock and settled on the other).
if grows or (clk == 103) ~= given then
  redis.call('SET', key, value, 'PX', px(ea, now, given, ARGV[6]))
else
  redis.call('SET', key, value, 'KEEPTTL')
end
-- A duplicate waiting for this record (`wait_settled`) listens on its key's name.
redis.call('PUBLISH', key, '')
return ea
