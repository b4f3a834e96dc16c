-- KEYS[1] record. ARGV: token (8 bytes, as stored), now ('' for Redis's clock), lease (µs),
-- grace (ms), and for a checkpoint the recovery point to record. Answers 0 when the token no
-- longer holds the record in progress, else the end of its retention (µs); a repeat just
-- extends the lease again.
local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) ~= 'string' or string.sub(v, 3, 10) ~= ARGV[1] or string.sub(v, 1, 1) ~= 'i' then
  return 0
end
local r = parse(v, true)
if not (r and derive(r, key)) then return 0 end
local given = ARGV[2] ~= ''
local now = clock(ARGV[2])
local le = now + ARGV[3]
local ea = r.ea
if le > ea then ea = le end
local point
if #ARGV == 5 then point = ARGV[5] elseif r.rpn > 0 then point = string.sub(v, r.fp_end + 1, r.rp_end) end
local rpn = 0
if point then rpn = #point + 1 end
local clk = 'r'
if given then clk = 'g' end
local value = struct.pack(HEADER, 'i', clk, r.tok, r.ca, now, le, ea, r.nonce, r.fpn, rpn, 0, 0, 0)
value = string.sub(value, 1, 54) .. string.sub(v, 55, r.fp_end) .. (point or '')
  .. string.sub(v, r.rp_end + 1, r.body)
redis.call('SET', key, value, 'PX', px(ea, now, given, ARGV[4]))
-- A lease ended by its holder (a checkpoint of lease 0, the flow's release once steps have
-- committed) can be taken over at once: a duplicate waiting on the record is told, as for
-- a release (`wait_settled`).
if tonumber(ARGV[3]) <= 0 then redis.call('PUBLISH', key, '') end
return ea
