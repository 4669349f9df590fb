local marked = 0
for i = 3, #ARGV do
  local job = job_key(ARGV[i])
  if redis.call('HGET', job, 'state') == 'dead' and
      redis.call('HSETNX', job, 'reconciled', '1') == 1 then
    marked = marked + 1
  end
end
-- move the cursor over the reconciled head of the dead-letter stream, so the next
-- unreconciled page starts after it
local ckey = P .. ':dead_cursor'
local cursor = redis.call('GET', ckey) or '0-0'
for _ = 1, 20 do
  local page = redis.call('XRANGE', P .. ':dead', '(' .. cursor, '+', 'COUNT', 100)
  if #page == 0 then break end
  local stop = false
  for _, e in ipairs(page) do
    local h = redis.call('HMGET', job_key(e[2][2]), 'state', 'dead_entry', 'reconciled')
    if h[1] == 'dead' and h[2] == e[1] and not h[3] then stop = true break end
    cursor = e[1]
  end
  if stop then break end
end
redis.call('SET', ckey, cursor)
return marked
