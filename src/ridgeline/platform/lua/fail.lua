local id, token, err, retry = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local job = job_key(id)
if not holds(job, token) then return 'lost' end
local h = redis.call('HMGET', job, 'kind', 'attempts', 'max_attempts')
local kind = h[1]
if tonumber(h[2]) >= tonumber(h[3]) then
  bury(job, id, kind, err)
  count('leased', 'dead')
  return 'dead'
end
release(job, kind)
redis.call('HSET', job, 'state', 'queued', 'last_error', err, 'lease_token', '')
if retry > 0 then
  redis.call('ZADD', P .. ':delayed', now_ms() + retry, id)
else
  push(job, id, kind)
end
count('leased', 'queued')
return 'queued'
