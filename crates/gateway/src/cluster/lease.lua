local n = tonumber(ARGV[1])
local span = tonumber(ARGV[2])
local at = tonumber(ARGV[5])
local want = tonumber(ARGV[6])
local t = redis.call('TIME')
local server = math.floor((tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) / tonumber(ARGV[7]))
local now = math.min(tonumber(ARGV[4]), server)
if at > server + 1 then want = 0 end
local seq = tonumber(ARGV[9])
local ms = tonumber(t[1]) * 1000
local last = redis.call('HGET', KEYS[2], ARGV[8])
local fresh = seq > (last and tonumber(string.match(last, '^(%d+)')) or 0)
if fresh then
  if redis.call('HLEN', KEYS[2]) > 64 then
    -- Nodes gone for an hour (restarted under another id) have no ask in flight.
    local seen = redis.call('HGETALL', KEYS[2])
    for i = 1, #seen, 2 do
      local at = tonumber(string.match(seen[i + 1], ':(%d+)$') or '0')
      if at < ms - 3600000 then redis.call('HDEL', KEYS[2], seen[i]) end
    end
  end
  redis.call('HSET', KEYS[2], ARGV[8], ARGV[9] .. ':' .. ms)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  for i = 10, #ARGV, 2 do
    local s = tonumber(ARGV[i])
    if s >= now - span and s <= server + 1 then
      local v = redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
      if v <= 0 then redis.call('HDEL', KEYS[1], ARGV[i]) end
    end
  end
else
  want = 0
end
local flat = redis.call('HGETALL', KEYS[1])
local counts = {}
local total = 0
for i = 1, #flat, 2 do
  local s = tonumber(flat[i])
  if s < now - span then
    redis.call('HDEL', KEYS[1], flat[i])
  elseif s >= at - span then
    local c = tonumber(flat[i + 1])
    total = total + c
    counts[#counts + 1] = {s, c}
  end
end
local over = 0
if fresh then over = math.max(0, total - n) end
local grant = 0
if want > 0 and total < n then
  grant = math.min(want, n - total)
  redis.call('HINCRBY', KEYS[1], ARGV[5], grant)
  total = total + grant
  counts[#counts + 1] = {at, grant}
end
local free_at = 0
if total >= n then
  table.sort(counts, function(a, b) return a[1] < b[1] end)
  local left = total
  for _, sc in ipairs(counts) do
    left = left - sc[2]
    if left < n then
      free_at = sc[1] + span + 1
      break
    end
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local ran = 0
if fresh then ran = 1 end
return {grant, total, free_at, over, ran}
