-- KEYS: records (on a cluster, one). ARGV: before ('' for Redis's clock). For each key, in
-- order: -1 if it was deleted (its retention, and any lease, ended by then), -3 if it was a
-- tombstone so deleted, -2 if it holds nothing idempo can read (left alone), else when it
-- may be purged (µs).
local before = clock(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  local r = parse(redis.pcall('GETRANGE', key, 0, 58), false)
  if not (r and derive(r, key)) then
    out[i] = -2
  else
    local due = r.ea
    if r.st == 'i' and r.le > due then due = r.le end
    if due <= before then
      redis.call('DEL', key)
      out[i] = -1
      if r.st == 'x' then out[i] = -3 end
    else
      out[i] = due
    end
  end
end
return out
