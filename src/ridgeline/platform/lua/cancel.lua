local id = ARGV[3]
local job = job_key(id)
local h = redis.call('HMGET', job, 'state', 'kind')
if h[1] ~= 'queued' and h[1] ~= 'leased' then return 0 end
redis.call('ZREM', P .. ':delayed', id)
release(job, h[2])
redis.call('HSET', job, 'state', 'cancelled', 'lease_token', '')
count(h[1], 'cancelled')
return 1
