-- KEYS[1] record. ARGV: now ('' for Redis's clock), lease, ttl (µs), grace (ms), nonce,
-- fingerprint (as stored), its length code, principal, operation, key.
--
-- The reservation's second step, after a plain SET NX found a record the caller could not
-- judge alone (one in progress, a tombstone, a record on another clock, one of the previous
-- layout): take it over if its lease or its retention ended, else hand it back. Answers
-- (_protocol.reservation decodes them):
--   {1, token, point, taken}   acquired; taken is 1 for a takeover of an ended lease
--   {0, now, value, expiry}    the record, for the caller to judge at ``now`` (expiry: the
--                              key's PEXPIRETIME when its times derive from it, else 0)
--   {2, why}                   the key holds nothing idempo can read
-- A token is max(old token + 1, Redis's clock in µs): it grows on every takeover, past a
-- tombstone's, and past the clock the fresh reservations' tokens estimate.
local key = KEYS[1]
local given = ARGV[1] ~= ''
local t = redis.call('TIME')
local clock_now = t[1] * 1000000 + t[2]
local now = clock_now
if given then now = tonumber(ARGV[1]) end
local v = redis.pcall('GET', key)
if type(v) == 'table' then
  local why
  v, why = upgrade(key, clock_now)
  if not v then return {2, why} end
end
local old, created, point, taken = false, false, false, 0
if v then
  local r = parse(v, true)
  if not (r and derive(r, key)) then return {2, 'not a record idempo can read'} end
  old = r.tok
  if r.st ~= 'x' and r.ea > now then
    local expiry = 0
    if r.clk == 'd' then expiry = r.ea / 1000 end
    if r.st ~= 'i' then return {0, now, v, expiry} end
    if r.nonce == ARGV[5] then
      if r.rpn > 0 then return {1, r.tok, string.sub(v, r.fp_end + 1, r.rp_end), 0} end
      return {1, r.tok, false, 0}
    end
    if string.sub(v, 60, r.fp_end) ~= ARGV[6] or r.le > now then return {0, now, v, expiry} end
    created, taken = r.ca, 1
    if r.rpn > 0 then point = string.sub(v, r.fp_end + 1, r.rp_end) end
  end
end
local token = clock_now
if old and old >= token then token = old + 1 end
local ea = now + ARGV[2] + ARGV[3]
local clk = 'r'
if given then clk = 'g' end
local rpn = 0
if point then rpn = #point + 1 end
redis.call('SET', key,
  struct.pack(HEADER, 'i', clk, token, created or now, now, now + ARGV[2], ea, ARGV[5], ARGV[7],
    rpn, #ARGV[8], #ARGV[9], #ARGV[10])
  .. ARGV[6] .. (point or '') .. ARGV[8] .. ARGV[9] .. ARGV[10],
  'PX', px(ea, now, given, ARGV[4]))
return {1, token, point, taken}
