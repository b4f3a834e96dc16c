-- The helpers of every script but settle (the loader prepends this file after common.lua).

-- The header of ``v`` as a table (offsets are 1-based positions in ``v``), or nil if ``v`` is
-- not one of ours. ``whole``: ``v`` is the whole value, not just its header.
local function parse(v, whole)
  if type(v) ~= 'string' or #v < 59 then return nil end
  local st, clk, tok, ca, ua, le, ea, nonce, fpn, rpn, pn, on, kn = struct.unpack(HEADER, v)
  if not (st == 'i' or st == 'c' or st == 'f' or st == 'x') then return nil end
  if not (clk == 'r' or clk == 'g' or clk == 'd') then return nil end
  local fp_len = fpn % 32768
  local rp_len = rpn > 0 and rpn - 1 or 0
  local r = {st = st, clk = clk, tok = tok, ca = ca, ua = ua, le = le, ea = ea, nonce = nonce,
    fpn = fpn, rpn = rpn, fp_end = 59 + fp_len, rp_end = 59 + fp_len + rp_len}
  r.body = r.rp_end + pn + on + kn
  if whole and #v < r.body then return nil end
  return r
end

-- Makes a 'd' record's times absolute, from the key's expiry on Redis's clock; false if the
-- key has none (something else changed it).
local function derive(r, key)
  if r.clk ~= 'd' then return true end
  local x = redis.call('PEXPIRETIME', key)
  if x < 0 then return false end
  x = x * 1000
  r.ca = x - r.ea
  r.ua = r.ca
  r.le = r.ca + r.le
  r.ea = x
  return true
end

-- The tombstone of record ``v``: its clock, token, times and nonce, and nothing else.
local function tombstone(v)
  return 'x' .. string.sub(v, 2, 50) .. NO_STRINGS
end

-- Converts in place a record of the previous layout (a hash) and returns its new value: a
-- tombstone if its retention ended; nil and why for a key that holds no such record. A
-- reservation whose lease is still running (on Redis's clock, as that layout's were) is
-- answered as the string but left a hash: its holder, a process of the previous version
-- during a rolling upgrade, can then still renew and settle it, where a converted record
-- would fence it out and let its work run again once the lease ended.
local function upgrade(key, now)
  if redis.call('TYPE', key).ok ~= 'hash' then return nil, 'a key of another type' end
  local f = redis.call('HMGET', key, 'p', 'o', 'k', 'fp', 'st', 'tok', 'le', 'ca', 'ua', 'ea',
    'rp', 'resp')
  local st = ({in_progress = 'i', completed = 'c', failed = 'f'})[f[5]]
  local tok, le, ca, ua, ea = tonumber(f[6]), tonumber(f[7]), tonumber(f[8]), tonumber(f[9]),
    tonumber(f[10])
  if not (f[1] and f[2] and f[3] and f[4] and st and tok and ca and ua and ea)
    or (st == 'i' and not le) or (st ~= 'i' and not f[12]) then
    return nil, 'fields missing or malformed'
  end
  local fp, fpn = f[4], #f[4]
  if #fp == 64 and not string.find(fp, '[^0-9a-f]') then
    fp = string.gsub(fp, '..', function(h) return string.char(tonumber(h, 16)) end)
    fpn = 32768 + 32
  end
  local rp = f[11]
  local v = struct.pack(HEADER, st, 'r', tok, ca, ua, st == 'i' and le or 0, ea, NO_NONCE, fpn,
    rp and #rp + 1 or 0, #f[1], #f[2], #f[3]) .. fp .. (rp or '') .. f[1] .. f[2] .. f[3]
    .. (st == 'i' and '' or f[12])
  if st == 'i' and le > now and ea > now then return v end
  if ea <= now then
    v = tombstone(v)
    redis.call('SET', key, v, 'KEEPTTL')
  else
    redis.call('SET', key, v, 'PX', px(ea, now, false, 0))
  end
  return v
end
