-- load
local cur = redis.call('GET', KEYS[1])
if cur and string.match(cur, '^%S+') ~= ARGV[1] then return 0 end
redis.call('EXISTS', KEYS[3])
local fence = redis.call('INCR', KEYS[2])
local lease = ARGV[1] .. ' ' .. string.format('%d', fence)
redis.call('SET', KEYS[1], lease, 'PX', 15000)
-- save
local c2 = redis.call('GET', KEYS[1])
local held = c2 == lease
redis.call('DEL', KEYS[1], KEYS[4])
return 1
