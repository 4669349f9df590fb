local id = ARGV[3]
local job = job_key(id)
local h = redis.call('HMGET', job, 'state', 'kind', 'dead_entry')
if h[1] ~= 'dead' then return 0 end
if h[3] then redis.call('XDEL', P .. ':dead', h[3]) end
redis.call('HDEL', job, 'dead_entry', 'reconciled')
redis.call('HSET', job, 'state', 'queued', 'attempts', 0)
push(job, id, h[2])
count('dead', 'queued')
return 1
