local id, token, lease, max_idle = ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local job = job_key(id)
if not holds(job, token) then return 0 end
local h = redis.call('HMGET', job, 'kind', 'worker', 'entry')
redis.call('XCLAIM', job_stream(job, h[1]), G, h[2], 0, h[3], 'IDLE', max_idle - lease,
           'JUSTID')
redis.call('HSET', job, 'lease_until_ms', now_ms() + lease)
return 1
