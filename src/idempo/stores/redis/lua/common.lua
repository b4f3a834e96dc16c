-- Helpers that renew.lua and purge.lua start with (the loader prepends this file).
local function us(n) return string.format('%d', n) end
local function clock(given)
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end
local function ttl_ms(expires_at, now)
  local ms = math.floor((expires_at - now) / 1000)
  if ms < 0 then ms = 0 end
  return us(ms + ARGV[#ARGV])
end
