-- The leader's finish, fenced by the lock and by the change fence (see
-- finish.rs): `finish_one(K, A)` for one item, K and A its KEYS and ARGV
-- by name, as `Finish` in finish.rs sends them; finish.rs adds the call,
-- or the loop that calls it for each item sent. Placeholders (upper-case
-- names after a dollar sign) are the envelope's layout, filled in from the
-- constants of cache/entry.rs (Lua strings count from 1).
local function valid(s)
  return s and string.len(s) >= $HEADER and string.byte(s, $VERSION_AT) == $VERSION
end
local function status(s) return string.byte(s, $STATUS) end
local function u(s, at, n)
  local v = 0
  for i = at, at + n - 1 do v = v * 256 + string.byte(s, i) end
  return v
end
local function u64(s, at) return u(s, at, 8) end
-- When the load of an entry began reading (stored_at less the load time).
local function read_at(s) return u64(s, $STORED_AT) - math.ceil(u(s, $LOAD_AT, 4) / 1000) end
local function backoff(s)
  return string.sub(s, 1, $FLAGS - 1) .. string.char(bit.bor(string.byte(s, $FLAGS), $BACKOFF)) .. string.sub(s, $FLAGS + 1)
end

local function finish_one(K, A)
  local entry = A.entry
  local holder = redis.call('GET', K.lock)
  local ours = holder == A.token
  local released = 0
  -- A change was applied to the item since this leader looked at the fence,
  -- before its read: what it read may be older than the change. Nothing is
  -- stored; the waiters are told to elect a leader again.
  if (redis.call('GET', K.fence) or '') ~= A.fence then
    redis.call(A.publish, A.channel, A.retry)
    if ours then
      redis.call('DEL', K.lock)
      released = 1
    end
    return {released, A.retry, 1}
  end
  -- The entry there now: needed unless this leader holds the lock and
  -- stores what it read (it then writes whatever is there).
  local current = nil
  if not ours or status(entry) == $FAILED then
    current = redis.call('GET', K.value)
    if not valid(current) then current = nil end
  end
  local may_write = ours or (not holder and (not current or u64(current, $STORED_AT) <= u64(entry, $STORED_AT)))
  local payload = entry
  local publish = true
  if not may_write then
    if current then payload = current else publish = false end
  elseif status(entry) == $FAILED then
    if current and status(current) ~= $FAILED and u64(current, $FRESH_UNTIL) > tonumber(A.now)
        and read_at(current) >= tonumber(A.cutoff) then
      payload = current
    else
      -- The last good copy: the value (a found entry past freshness), else
      -- the fail-safe copy (found, or the tombstone of a deleted item);
      -- never one read before the cutoff of `invalidate --all`.
      local copy = nil
      if current and status(current) == $FOUND then
        copy = current
      else
        copy = redis.call('GET', K.fail_safe)
        if not (valid(copy) and status(copy) ~= $FAILED) then copy = nil end
      end
      if copy and read_at(copy) < tonumber(A.cutoff) then copy = nil end
      if copy then payload = backoff(copy) end
      if tonumber(A.failure_ms) > 0 then
        redis.call('SET', K.value, payload, 'PX', A.failure_ms)
      end
    end
  else
    if tonumber(A.value_ms) > 0 then
      redis.call('SET', K.value, entry, 'PX', A.value_ms)
    end
    if tonumber(A.fail_safe_ms) == 0 then
      redis.call('DEL', K.fail_safe)
    elseif status(entry) == $FOUND then
      redis.call('SET', K.fail_safe, entry, 'PX', A.fail_safe_ms)
    else
      -- Not found: a copy kept for an item that existed becomes its
      -- tombstone; none is made for an item never seen.
      redis.call('SET', K.fail_safe, entry, 'PX', A.fail_safe_ms, 'XX')
    end
  end
  if publish then
    redis.call(A.publish, A.channel, payload)
  end
  if ours then
    redis.call('DEL', K.lock)
    released = 1
  end
  return {released, payload, 0}
end
