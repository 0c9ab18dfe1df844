-- The leader's finish, fenced by the lock and by the change fence (see
-- FINISH_LUA in scripts.rs). Placeholders (upper-case names after a dollar
-- sign) are the envelope's layout, filled in from the constants of
-- cache/entry.rs (Lua strings count from 1).
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

local entry = ARGV[1]
local holder = redis.call('GET', KEYS[2])
local ours = holder == ARGV[3]
local released = 0
-- A change was applied to the item since this leader looked at the fence,
-- before its read: what it read may be older than the change. Nothing is
-- stored; the waiters are told to elect a leader again.
if (redis.call('GET', KEYS[4]) or '') ~= ARGV[9] then
  redis.call(ARGV[7], ARGV[4], ARGV[11])
  if ours then
    redis.call('DEL', KEYS[2])
    released = 1
  end
  return {released, ARGV[11], 1}
end
local current = redis.call('GET', KEYS[1])
if not valid(current) then current = nil end
local may_write = ours or (not holder and (not current or u64(current, $STORED_AT) <= u64(entry, $STORED_AT)))
local payload = entry
local publish = true
if not may_write then
  if current then payload = current else publish = false end
elseif status(entry) == $FAILED then
  if current and status(current) ~= $FAILED and u64(current, $FRESH_UNTIL) > tonumber(ARGV[8])
      and read_at(current) >= tonumber(ARGV[10]) then
    payload = current
  else
    -- The last good copy: the value (a found entry past freshness), else
    -- the fail-safe copy (found, or the tombstone of a deleted item);
    -- never one read before the cutoff of `invalidate --all`.
    local copy = nil
    if current and status(current) == $FOUND then
      copy = current
    else
      copy = redis.call('GET', KEYS[3])
      if not (valid(copy) and status(copy) ~= $FAILED) then copy = nil end
    end
    if copy and read_at(copy) < tonumber(ARGV[10]) then copy = nil end
    if copy then payload = backoff(copy) end
    if tonumber(ARGV[6]) > 0 then
      redis.call('SET', KEYS[1], payload, 'PX', ARGV[6])
    end
  end
else
  if tonumber(ARGV[2]) > 0 then
    redis.call('SET', KEYS[1], entry, 'PX', ARGV[2])
  end
  if tonumber(ARGV[5]) == 0 then
    redis.call('DEL', KEYS[3])
  elseif status(entry) == $FOUND then
    redis.call('SET', KEYS[3], entry, 'PX', ARGV[5])
  else
    -- Not found: a copy kept for an item that existed becomes its
    -- tombstone; none is made for an item never seen.
    redis.call('SET', KEYS[3], entry, 'PX', ARGV[5], 'XX')
  end
end
if publish then
  redis.call(ARGV[7], ARGV[4], payload)
end
if ours then
  redis.call('DEL', KEYS[2])
  released = 1
end
return {released, payload, 0}
