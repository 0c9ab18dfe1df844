-- Changes applied to items' keys (see apply.rs): `apply_one(K, A)` for one
-- item, K and A its KEYS and ARGV by name; apply.rs adds the loop that calls
-- it for each item sent. Placeholders as in finish.lua.
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

local function apply_one(K, A)
  -- Applied already (by this instance or another): nothing to do. By id,
  -- not by order: ids are handed out before commit, so a change may commit
  -- (and arrive) after one with a higher id.
  if redis.call('SISMEMBER', K.applied, A.change) == 1 then
    return 0
  end
  local value = redis.call('GET', K.value)
  -- Something to fence (a stored value, or a leader at work, which may have
  -- read the row before the change): the fence becomes this change, a value
  -- no earlier fence had, and the change is remembered as applied. The
  -- replication feed fences every change (its LSN): a later load from a
  -- read replica must have replayed it.
  local fence = A.always_fence == '1' or value or redis.call('EXISTS', K.lock) == 1
  if A.kind == 'delete' then
    -- Deleted: the value goes (the next read loads and stores the post's
    -- absence: a tombstone written here could land over a newer value, a
    -- post inserted again and stored before this deletion was applied),
    -- and a tombstone takes the fail-safe copy's place, so that a failed
    -- load never serves the old body again.
    if value then
      redis.call('DEL', K.value)
    end
    if tonumber(A.tombstone_copy_ms) > 0 then
      redis.call('SET', K.fail_safe, A.tombstone, 'PX', A.tombstone_copy_ms, 'XX')
    else
      redis.call('DEL', K.fail_safe)
    end
  else
    local grace = tonumber(A.grace_ms)
    if value and grace > 0 and valid(value) and status(value) == $FOUND and not backoff(value) then
      -- Stale-while-revalidate: the body stays, fresh until now, so readers
      -- get it marked stale while one refresh reloads it; the key lives no
      -- longer than the grace window.
      if u64(value, $FRESH_UNTIL) > u64(A.now, 1) then
        value = string.sub(value, 1, $FRESH_UNTIL - 1) .. A.now .. string.sub(value, $FRESH_UNTIL + 8)
      end
      local left = redis.call('PTTL', K.value)
      if left < 0 or left > grace then left = grace end
      redis.call('SET', K.value, value, 'PX', math.max(left, 1))
    elseif value then
      redis.call('DEL', K.value)
    end
    -- A tombstone kept for the item goes: it exists again.
    local copy = redis.call('GET', K.fail_safe)
    if valid(copy) and status(copy) == $NOT_FOUND then
      redis.call('DEL', K.fail_safe)
    end
  end
  -- Last, so that a script stopped part-way is applied again in full.
  if fence then
    redis.call('SET', K.fence, A.change, 'PX', A.fence_ms)
    redis.call('SADD', K.applied, A.change)
    redis.call('PEXPIRE', K.applied, A.fence_ms)
  end
  return 1
end
