local id, kind, payload, max, delay = ARGV[3], ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[7])
local group = ARGV[8]
local job = job_key(id)
if redis.call('EXISTS', job) == 1 then return 0 end
local now = now_ms()
-- the length prefix keeps (kind, group) pairs apart whatever characters they hold
local lane = P .. ':lane:' .. #kind .. ':' .. kind .. ':' .. group
redis.call('HSET', job, 'id', id, 'kind', kind, 'payload', payload, 'state', 'queued',
           'attempts', 0, 'max_attempts', max, 'created_ms', now, 'lane', lane,
           'group', group)
if delay > 0 then
  redis.call('ZADD', P .. ':delayed', now + delay, id)
else
  push(job, id, kind)
end
count(nil, 'queued')
return 1
