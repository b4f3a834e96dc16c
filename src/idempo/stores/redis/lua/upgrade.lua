-- KEYS[1] a record of the previous layout (a hash). Converts it in place (common.lua's
-- upgrade) and answers {1, its new value}, or {2, why} for a key that holds no such record.
local v, why = upgrade(KEYS[1], clock(''))
if not v then return {2, why} end
return {1, v}
