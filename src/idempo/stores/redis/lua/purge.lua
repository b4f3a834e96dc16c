-- KEYS[1] record. ARGV: before ('' for Redis's clock). Deletes it if its retention (and any
-- lease) ended by then; a key holding no readable record is left for evict. (Runs after
-- common.lua.)
local r = redis.pcall('HMGET', KEYS[1], 'st', 'ea', 'le')
if r.err then return 0 end
local ea = tonumber(r[2])
if not (r[1] and ea) then return 0 end
local before = clock(ARGV[1])
if ea > before then return 0 end
local le = tonumber(r[3])
if r[1] == 'in_progress' and le and le > before then return 0 end
return redis.call('DEL', KEYS[1])
