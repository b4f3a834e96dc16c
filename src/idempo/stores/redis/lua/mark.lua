-- KEYS[1] record. What a duplicate about to wait for the record (`wait_settled`) runs once it
-- is subscribed to the key's name: answers 1 if the record is in progress (wait for a
-- publication), else 0 (settled, released, gone or unreadable: the reservation that follows
-- meets it).
--
-- The settle of a fresh reservation ('d') publishes nothing, since mostly nobody waits: this
-- makes such a record one on Redis's clock ('r', the same times, token and nonce, the key's
-- TTL kept), whose settle publishes. Both scripts are atomic and the waiter subscribed
-- first, so either the settle came before (this answers 0) or it finds 'r' and publishes to
-- a subscriber that hears it. Every other record's settle, release or ended lease publishes.
local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) == 'table' then
  -- The previous layout's record: its holder, a process of that version, publishes nothing;
  -- the wait ends with its bound, as it always did.
  v = upgrade(key, clock(''))
end
local r = parse(v, true)
if not r or r.st ~= 'i' then return 0 end
if r.clk == 'd' then
  if not derive(r, key) then return 0 end
  redis.call('SET', key, struct.pack('>c1c1i8i8i8i8i8', 'i', 'r', r.tok, r.ca, r.ua, r.le, r.ea)
    .. string.sub(v, 43), 'KEEPTTL')
end
return 1
