local worker, token, lease, max_idle = ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()

-- delayed jobs that are due join their stream
local delayed = P .. ':delayed'
for _, id in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, 100)) do
  redis.call('ZREM', delayed, id)
  local job = job_key(id)
  local h = redis.call('HMGET', job, 'state', 'kind')
  if h[1] == 'queued' then push(job, id, h[2]) end
end

-- the lanes (streams) of the kinds asked for: {stream, kind, group}
local wanted = nil
if #ARGV > 6 then
  wanted = {}
  for i = 7, #ARGV do wanted[ARGV[i]] = true end
end
local lanes = {}
local groups = redis.call('HGETALL', P .. ':lane_group')
local group_of = {}
for i = 1, #groups, 2 do group_of[groups[i]] = groups[i + 1] end
local all = redis.call('HGETALL', P .. ':lanes')
for i = 1, #all, 2 do
  if wanted == nil or wanted[all[i + 1]] then
    lanes[#lanes + 1] = {all[i], all[i + 1], group_of[all[i]] or ''}
  end
end
for _, kind in ipairs(redis.call('SMEMBERS', P .. ':kinds')) do  -- pre-group streams
  if wanted == nil or wanted[kind] then lanes[#lanes + 1] = {stream_key(kind), kind, ''} end
end
table.sort(lanes, function(a, b) return a[1] < b[1] end)

local function grant(job, id, kind, s, eid, last_error)
  local attempts = redis.call('HINCRBY', job, 'attempts', 1)
  redis.call('HSET', job, 'state', 'leased', 'lease_token', token, 'worker', worker,
             'lease_until_ms', now + lease, 'entry', eid)
  if last_error then redis.call('HSET', job, 'last_error', last_error) end
  redis.call('XCLAIM', s, G, worker, 0, eid, 'IDLE', max_idle - lease, 'JUSTID')
  local h = redis.call('HMGET', job, 'payload', 'max_attempts', 'last_error')
  return {id, kind, h[1], attempts, tonumber(h[2]), token, h[3] or false}
end

local function served(group)
  redis.call('HSET', P .. ':served', group, redis.call('INCR', P .. ':serial'))
end

-- 1. leases that expired: their holders stopped heartbeating
for _, lane in ipairs(lanes) do
  local s, kind = lane[1], lane[2]
  if redis.call('EXISTS', s) == 1 then
    local ckey = P .. ':cursor:' .. s
    local cursor = redis.call('GET', ckey) or '0-0'
    for _ = 1, 10 do
      local r = redis.call('XAUTOCLAIM', s, G, worker, max_idle, cursor, 'COUNT', 1)
      cursor = r[1]
      local entry = r[2][1]
      if entry and entry[2] then
        local eid, id = entry[1], entry[2][2]
        local job = job_key(id)
        local h = redis.call('HMGET', job, 'state', 'entry', 'attempts', 'max_attempts',
                             'worker')
        if h[1] ~= 'leased' or h[2] ~= eid then
          redis.call('XACK', s, G, eid)  -- an orphan entry: nothing holds it
          redis.call('XDEL', s, eid)
        else
          local attempts, max = tonumber(h[3]), tonumber(h[4])
          local err = 'lease expired: worker ' .. (h[5] or '?') ..
                      ' stopped heartbeating (attempt ' .. attempts .. ' of ' .. max .. ')'
          if attempts >= max then
            bury(job, id, kind, err)
            count('leased', 'dead')
          else
            redis.call('SET', ckey, cursor)
            served(lane[3])
            return grant(job, id, kind, s, eid, err)
          end
        end
      end
      if cursor == '0-0' then break end
    end
    redis.call('SET', ckey, cursor)
  end
end

-- 2. the next entry not yet delivered: of the group served least recently (round robin
-- over groups), the oldest of its lanes
local function older(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
local serial = {}
local s_all = redis.call('HGETALL', P .. ':served')
for i = 1, #s_all, 2 do serial[s_all[i]] = tonumber(s_all[i + 1]) end
for _ = 1, 100 do
  local best, best_id, best_serial = nil, nil, nil
  for _, lane in ipairs(lanes) do
    local s = lane[1]
    if redis.call('EXISTS', s) == 1 then
      if redis.call('XLEN', s) == 0 and redis.call('HEXISTS', P .. ':lanes', s) == 1 then
        -- an empty lane: forget it (a later job of its kind and group makes it again)
        redis.call('DEL', s, P .. ':cursor:' .. s)
        redis.call('HDEL', P .. ':lanes', s)
        redis.call('HDEL', P .. ':lane_group', s)
      else
        for _, g in ipairs(redis.call('XINFO', 'GROUPS', s)) do
          local f = {}
          for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
          if f['name'] == G then
            local nxt = redis.call('XRANGE', s, '(' .. f['last-delivered-id'], '+', 'COUNT', 1)
            if nxt[1] then
              local rank = serial[lane[3]] or 0
              if best == nil or rank < best_serial
                  or (rank == best_serial and older(nxt[1][1], best_id)) then
                best, best_id, best_serial = lane, nxt[1][1], rank
              end
            end
          end
        end
      end
    end
  end
  if not best then return false end
  local s, best_kind = best[1], best[2]
  local got = redis.call('XREADGROUP', 'GROUP', G, worker, 'COUNT', 1, 'STREAMS', s, '>')
  local eid, id = got[1][2][1][1], got[1][2][1][2][2]
  local job = job_key(id)
  local h = redis.call('HMGET', job, 'state', 'entry')
  if h[1] == 'queued' and h[2] == eid then
    count('queued', 'leased')
    served(best[3])
    return grant(job, id, best_kind, s, eid, nil)
  end
  redis.call('XACK', s, G, eid)  -- an orphan entry (its job was cancelled or removed)
  redis.call('XDEL', s, eid)
end
return false
