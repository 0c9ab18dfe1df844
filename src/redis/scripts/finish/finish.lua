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
local function has(s, flag) return bit.band(string.byte(s, $FLAGS), flag) ~= 0 end
-- n as 8 big-endian bytes (exact below 2^53: unix milliseconds are).
local function be64(n)
  local bytes = {}
  for i = 8, 1, -1 do
    bytes[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(bytes)
end
-- A copy re-served after a failed load until `until_ms`: flagged BACKOFF, no
-- longer INVALIDATED (it is served on purpose).
local function backoff(s, until_ms)
  local flags = bit.band(bit.bor(string.byte(s, $FLAGS), $BACKOFF), bit.bnot($INVALIDATED))
  return string.sub(s, 1, $FLAGS - 1) .. string.char(flags)
    .. string.sub(s, $FLAGS + 1, $BACKOFF_UNTIL - 1) .. be64(until_ms)
    .. string.sub(s, $BACKOFF_UNTIL + 8)
end
-- A copy of the item: a found entry, or a not-found one (a tombstone: the
-- item existed, or a negative entry, which is as good).
local function is_copy(s) return status(s) == $FOUND or status(s) == $NOT_FOUND end

-- What is published: `payload` framed with the item's fence as it is now
-- (cache/message.rs), by which a waiter that looked earlier judges it.
local function framed(K, payload)
  return string.char($FRAMED) .. (redis.call('GET', K.fence) or '') .. '\n' .. payload
end

-- Stores `value` at `key` for `ms`; true, for the caller's `wrote`.
local function store(key, value, ms)
  redis.call('SET', key, value, 'PX', ms)
  return true
end

local function finish_one(K, A)
  local entry = A.entry
  -- The lock is the value key itself when the leader claimed it absent (a
  -- claim, see cache/entry.rs): storing there releases the claim.
  local in_value = K.lock == K.value
  local holder = redis.call('GET', K.lock)
  local ours = holder == A.token
  local released = 0
  local wrote = false
  if in_value and not ours then
    -- The claim is gone: a change deleted it (what this leader read may be
    -- older than the change), or it expired. Nothing is stored. An entry
    -- another leader stored since is published; else the waiters are told
    -- to elect a leader again, as after a change.
    if valid(holder) then
      redis.call(A.publish, A.channel, framed(K, holder))
      return {0, holder, 0}
    end
    redis.call(A.publish, A.channel, A.retry)
    return {0, A.retry, 1}
  end
  -- A change was applied to the item since this leader looked at the fence,
  -- before its read: what it read may be older than the change. Nothing is
  -- stored; the waiters are told to elect a leader again. (A claim in the
  -- value key needs no fence: a change deletes it, above.)
  if not in_value and (redis.call('GET', K.fence) or '') ~= A.fence then
    redis.call(A.publish, A.channel, A.retry)
    if ours then
      redis.call('DEL', K.lock)
      released = 1
    end
    return {released, A.retry, 1}
  end
  -- The entry there now: needed unless this leader holds the lock and
  -- stores a found entry or a marker (it then writes whatever is there).
  local current = nil
  -- Another leader's claim in the value key (cache/entry.rs: its first
  -- byte is a NUL, never a version): its copy expired and it loads now.
  local claimed = false
  if not ours or status(entry) == $FAILED or status(entry) == $NOT_FOUND then
    current = redis.call('GET', K.value)
    claimed = not in_value and current ~= false and current ~= nil
      and string.byte(current, 1) == 0
    if not valid(current) then current = nil end
  end
  local may_write = ours or (not holder and (not current or u64(current, $STORED_AT) <= u64(entry, $STORED_AT)))
  local payload = entry
  local publish = true
  local now = tonumber(A.now)
  if not may_write then
    if current then payload = current else publish = false end
  elseif status(entry) == $FAILED and claimed then
    -- A failure over that claim would make every reader fail for
    -- FAILURE_TTL though its load may succeed: nothing is stored, and the
    -- waiters hear that leader's finish, not this failure.
    publish = false
  elseif status(entry) == $FAILED then
    if current and status(current) ~= $FAILED and not has(current, $INVALIDATED)
        and not has(current, $CHANGED) and u64(current, $FRESH_UNTIL) > now and read_at(current) >= tonumber(A.cutoff) then
      payload = current
    else
      -- The last good copy: what the value key keeps past freshness (found,
      -- or the tombstone of a deleted item), invalidated by a change or
      -- not; never one read before the cutoff of `invalidate --all`.
      local copy = nil
      if current and is_copy(current) and read_at(current) >= tonumber(A.cutoff) then
        copy = current
      end
      local failure_ms = tonumber(A.failure_ms)
      if copy then
        -- FAILURE_TTL off: nothing is stored, and the copy is only this
        -- finish's message, which its waiters judge as it arrives.
        payload = backoff(copy, now + (failure_ms > 0 and failure_ms or 1000))
        if failure_ms > 0 then
          -- As long as the copy had left, and at least the backoff.
          wrote = store(K.value, payload, math.max(redis.call('PTTL', K.value), failure_ms))
        end
      elseif failure_ms > 0 then
        wrote = store(K.value, payload, failure_ms)
      end
    end
  else
    local ms = tonumber(A.value_ms)
    -- Not found where a copy of the item was kept: the item existed, and
    -- this is its tombstone, kept as long as the copy would have been.
    if status(entry) == $NOT_FOUND and current and is_copy(current) and tonumber(A.tombstone_ms) > ms then
      ms = tonumber(A.tombstone_ms)
    end
    if ms > 0 then
      wrote = store(K.value, entry, ms)
    end
  end
  if publish then
    redis.call(A.publish, A.channel, framed(K, payload))
  end
  if ours then
    -- A claim in the value key was overwritten by what was stored.
    if not (in_value and wrote) then
      redis.call('DEL', K.lock)
    end
    released = 1
  end
  -- What the leader sent is not sent back (an empty string stands for it).
  if payload == entry then payload = '' end
  return {released, payload, 0}
end
