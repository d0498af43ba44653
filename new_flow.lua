local cur = redis.call('GET', KEYS[1])
local holder, fence, mark
if cur then holder, fence, mark = string.match(cur, '^(%S+) (%d+)(.*)$') end
if holder and holder ~= '-' and holder ~= ARGV[1] then return 0 end
if fence then fence = tonumber(fence) + 1 else fence = 1 end
local lease = ARGV[1] .. ' ' .. string.format('%d', fence)
redis.call('SET', KEYS[1], lease, 'PX', 15000)
local c2 = redis.call('GET', KEYS[1])
local held = c2 == lease or c2 == lease .. ' w'
redis.call('SET', KEYS[1], '- ' .. string.match(lease, '%d+$') .. (c2 and string.match(c2, ' w$') or ''), 'EX', 21600)
return 1
