-- The prelude of every script in this folder: queue.py prepends it to each one.
-- ARGV[1] is the key prefix P, ARGV[2] the consumer group G (the same prefix); a script's
-- own arguments start at ARGV[3].
--
-- Keys, for prefix P: P:job:<id> (hash: state, attempts, lease token, stream entry, the
-- stream it is in...), P:lane:<n>:<kind>:<group> (the stream of one kind and fairness
-- group, consumer group P), P:lanes (hash: lane stream -> kind) and P:lane_group (lane
-- stream -> group), P:served (hash: group -> serial of its last lease; P:serial counts),
-- P:delayed (sorted set of job ids by due time), P:dead (dead-letter stream), P:dead_cursor
-- (the dead entry up to which every job is reconciled), P:depth (hash of counts by state),
-- P:cursor:<stream> (where XAUTOCLAIM's scan of the group's pending list goes on).
-- P:stream:<kind> and P:kinds are the streams of jobs queued before groups existed: they
-- are still served, as lanes of group "". Times are the server's clock (TIME), so
-- workers' clocks do not matter.
--
-- The lease clock is the pending entry's idle time. Every entry a worker holds has its idle
-- time set (XCLAIM ... IDLE) to MAX_LEASE - lease, so it reaches MAX_LEASE exactly when the
-- lease ends, whatever each worker's lease_s; XAUTOCLAIM with min-idle MAX_LEASE then finds
-- precisely the expired leases. A heartbeat sets the idle time back the same way.
local P, G = ARGV[1], ARGV[2]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function job_key(id) return P .. ':job:' .. id end
local function stream_key(kind) return P .. ':stream:' .. kind end
local function job_stream(job, kind)  -- the lane the job is in (older jobs: their kind's)
  return redis.call('HGET', job, 'lane') or stream_key(kind)
end
local function count(from, to)
  if from then redis.call('HINCRBY', P .. ':depth', from, -1) end
  if to then redis.call('HINCRBY', P .. ':depth', to, 1) end
end
local function push(job, id, kind)
  local s = job_stream(job, kind)
  if redis.call('HSETNX', P .. ':lanes', s, kind) == 1 then
    redis.call('HSET', P .. ':lane_group', s, redis.call('HGET', job, 'group') or '')
  end
  redis.pcall('XGROUP', 'CREATE', s, G, '0', 'MKSTREAM')  -- BUSYGROUP when it exists
  redis.call('HSET', job, 'entry', redis.call('XADD', s, '*', 'id', id))
end
local function release(job, kind)  -- drop the job's stream entry (and pending entry)
  local e = redis.call('HGET', job, 'entry')
  if e then
    local s = job_stream(job, kind)
    redis.call('XACK', s, G, e)
    redis.call('XDEL', s, e)
    redis.call('HDEL', job, 'entry')
  end
end
local function bury(job, id, kind, err)  -- to the dead-letter stream
  release(job, kind)
  local d = redis.call('XADD', P .. ':dead', '*', 'id', id)
  redis.call('HSET', job, 'state', 'dead', 'last_error', err, 'dead_entry', d,
             'lease_token', '')
  redis.call('HDEL', job, 'reconciled')
end
local function holds(job, token)  -- is this lease token the job's current lease?
  local h = redis.call('HMGET', job, 'state', 'lease_token')
  return h[1] == 'leased' and h[2] == token
end
