-- Changes applied to items' keys (see apply.rs): `apply_one(K, A)` for one
-- item, K and A its KEYS and ARGV by name; apply.rs adds the loop that calls
-- it for each item sent. Placeholders as in finish/finish.lua.
local function valid(s)
  return s and string.len(s) >= $HEADER and string.byte(s, $VERSION_AT) == $VERSION
end
local function status(s) return string.byte(s, $STATUS) end
local function u64(s, at)
  local n = 0
  for i = at, at + 7 do n = n * 256 + string.byte(s, i) end
  return n
end
local function has(s, flag) return bit.band(string.byte(s, $FLAGS), flag) ~= 0 end
-- `s` with INVALIDATED set and BACKOFF cleared: never served to readers
-- again, kept as the fail-safe copy.
local function invalidated(s)
  local flags = bit.band(bit.bor(string.byte(s, $FLAGS), $INVALIDATED), bit.bnot($BACKOFF))
  return string.sub(s, 1, $FLAGS - 1) .. string.char(flags) .. string.sub(s, $FLAGS + 1)
end

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
  -- no earlier fence had (unless a later position is held, below), and the
  -- change is remembered as applied. The replication feed fences every
  -- change (its LSN): a later load from a read replica must have replayed
  -- it.
  local fence = A.always_fence == '1' or value or redis.call('EXISTS', K.lock) == 1
  local copy = value and valid(value) and (status(value) == $FOUND or status(value) == $NOT_FOUND)
  if A.kind == 'delete' then
    -- Deleted: a copy of the item gives way to its tombstone (a not-found
    -- entry, invalidated: never served to readers, since it could land over
    -- a newer value, a post inserted again and stored before this deletion
    -- was applied; a failed load serves it, never the old body). Anything
    -- else goes.
    if copy and tonumber(A.tombstone_copy_ms) > 0 then
      redis.call('SET', K.value, invalidated(A.tombstone), 'PX', A.tombstone_copy_ms)
    elseif value then
      redis.call('DEL', K.value)
    end
  elseif copy and status(value) == $FOUND then
    if tonumber(A.grace_ms) > 0 and not has(value, $BACKOFF) and not has(value, $INVALIDATED) then
      -- Stale-while-revalidate: fresh until now, so readers get it marked
      -- stale for the grace window while one refresh reloads it; flagged
      -- CHANGED, so that a reader whose clock is behind this one's never
      -- takes it for fresh (its grace window alone moves with the skew).
      if u64(value, $FRESH_UNTIL) > u64(A.now, 1) then
        value = string.sub(value, 1, $FRESH_UNTIL - 1) .. A.now .. string.sub(value, $FRESH_UNTIL + 8)
      end
      if not has(value, $CHANGED) then
        local flags = bit.bor(string.byte(value, $FLAGS), $CHANGED)
        value = string.sub(value, 1, $FLAGS - 1) .. string.char(flags) .. string.sub(value, $FLAGS + 1)
      end
      redis.call('SET', K.value, value, 'KEEPTTL')
    elseif not has(value, $INVALIDATED) then
      -- Never served again; the body stays as the fail-safe copy.
      redis.call('SET', K.value, invalidated(value), 'KEEPTTL')
    end
  elseif value then
    -- A negative entry (the item exists again), a marker, or bytes of
    -- another layout: nothing worth keeping.
    redis.call('DEL', K.value)
  end
  -- Last, so that a script stopped part-way is applied again in full.
  if fence then
    -- A fence that is a WAL position never falls: the replication feed's
    -- (commit LSNs) and `postcache invalidate`'s (where the WAL was after
    -- it recorded its change). A change applied after a later one (the
    -- posts read from a replica behind a change to every post, fenced with
    -- that change; a batch sent again) leaves the later fence, whose loads
    -- include this change, and a load claimed now must not read a replica
    -- behind it. (Positions compare exactly as Lua numbers below 2^53
    -- bytes of WAL.) The trigger feed's ids are handed out before commit,
    -- so its fence is simply replaced.
    local at = A.fence_at ~= '0' and A.fence_at or A.change
    local rising = A.always_fence == '1' or A.fence_at ~= '0'
    local held = rising and tonumber(redis.call('GET', K.fence))
    if not (held and held > tonumber(at)) then
      redis.call('SET', K.fence, at, 'PX', A.fence_ms)
    end
    redis.call('SADD', K.applied, A.change)
    redis.call('PEXPIRE', K.applied, A.fence_ms)
  end
  return 1
end
