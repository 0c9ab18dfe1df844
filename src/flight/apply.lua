-- A change to an item, applied to its keys (see APPLY_LUA in scripts.rs).
-- Placeholders as in finish.lua.
local function valid(s)
  return s and string.len(s) >= $HEADER and string.byte(s, $VERSION_AT) == $VERSION
end
local function status(s) return string.byte(s, $STATUS) end
local function u64(s, at)
  local n = 0
  for i = at, at + 7 do n = n * 256 + string.byte(s, i) end
  return n
end
local function backoff(s) return bit.band(string.byte(s, $FLAGS), $BACKOFF) ~= 0 end

-- Applied already (by this instance or another): nothing to do. By id,
-- not by order: ids are handed out before commit, so a change may commit
-- (and arrive) after one with a higher id.
if redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 then
  return 0
end
local value = redis.call('GET', KEYS[1])
-- Something to fence (a stored value, or a leader at work, which may have
-- read the row before the change): the fence becomes this change, a value
-- no earlier fence had, and the change is remembered as applied.
local fence = value or redis.call('EXISTS', KEYS[2]) == 1
if ARGV[2] == 'delete' then
  -- Deleted: a tombstone in place of what is kept, so that neither the
  -- value nor the fail-safe copy ever serves the old body again.
  if value then
    redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
  end
  if tonumber(ARGV[6]) > 0 then
    redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[6], 'XX')
  else
    redis.call('DEL', KEYS[3])
  end
else
  local grace = tonumber(ARGV[7])
  if value and grace > 0 and valid(value) and status(value) == $FOUND and not backoff(value) then
    -- Stale-while-revalidate: the body stays, fresh until now, so readers
    -- get it marked stale while one refresh reloads it; the key lives no
    -- longer than the grace window.
    if u64(value, $FRESH_UNTIL) > u64(ARGV[8], 1) then
      value = string.sub(value, 1, $FRESH_UNTIL - 1) .. ARGV[8] .. string.sub(value, $FRESH_UNTIL + 8)
    end
    local left = redis.call('PTTL', KEYS[1])
    if left < 0 or left > grace then left = grace end
    redis.call('SET', KEYS[1], value, 'PX', math.max(left, 1))
  elseif value then
    redis.call('DEL', KEYS[1])
  end
  -- A tombstone kept for the item goes: it exists again.
  local copy = redis.call('GET', KEYS[3])
  if valid(copy) and status(copy) == $NOT_FOUND then
    redis.call('DEL', KEYS[3])
  end
end
-- Last, so that a script stopped part-way is applied again in full.
if fence then
  redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[3])
  redis.call('SADD', KEYS[5], ARGV[1])
  redis.call('PEXPIRE', KEYS[5], ARGV[3])
end
return 1
