local id, token = ARGV[3], ARGV[4]
local job = job_key(id)
if not holds(job, token) then return 0 end
release(job, redis.call('HGET', job, 'kind'))
redis.call('HSET', job, 'state', 'done', 'done_ms', now_ms())
count('leased', 'done')
return 1
