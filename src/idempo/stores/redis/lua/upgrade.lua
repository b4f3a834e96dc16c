-- KEYS[1] a record of the previous layout (a hash). Converts it in place (record.lua's
-- upgrade; a reservation whose lease runs is only read) and answers {1, its value as a
-- string}, or {2, why} for a key that holds no such record.
local v, why = upgrade(KEYS[1], clock(''))
if not v then return {2, why} end
return {1, v}
