-- The leader's finish, fenced by the lock (see FINISH_LUA in redis.rs).
-- Placeholders (upper-case names after a dollar sign) are the envelope's layout,
-- filled in from the constants of cache/entry.rs (Lua strings count from 1).
local function valid(s)
  return s and string.len(s) >= $HEADER and string.byte(s, $VERSION_AT) == $VERSION
end
local function status(s) return string.byte(s, $STATUS) end
local function u64(s, at)
  local n = 0
  for i = at, at + 7 do n = n * 256 + string.byte(s, i) end
  return n
end
local function backoff(s)
  return string.sub(s, 1, $FLAGS - 1) .. string.char(bit.bor(string.byte(s, $FLAGS), $BACKOFF)) .. string.sub(s, $FLAGS + 1)
end

local entry = ARGV[1]
local holder = redis.call('GET', KEYS[2])
local ours = holder == ARGV[3]
local current = redis.call('GET', KEYS[1])
if not valid(current) then current = nil end
local may_write = ours or (not holder and (not current or u64(current, $STORED_AT) <= u64(entry, $STORED_AT)))
local payload = entry
local publish = true
if not may_write then
  if current then payload = current else publish = false end
elseif status(entry) == $FAILED then
  if current and status(current) ~= $FAILED and u64(current, $FRESH_UNTIL) > tonumber(ARGV[8]) then
    payload = current
  else
    local copy = nil
    if current and status(current) == $FOUND then
      copy = current
    elseif not (current and status(current) == $NOT_FOUND) then
      copy = redis.call('GET', KEYS[3])
      if not (valid(copy) and status(copy) == $FOUND) then copy = nil end
    end
    if copy then payload = backoff(copy) end
    if tonumber(ARGV[6]) > 0 then
      redis.call('SET', KEYS[1], payload, 'PX', ARGV[6])
    end
  end
else
  if tonumber(ARGV[2]) > 0 then
    redis.call('SET', KEYS[1], entry, 'PX', ARGV[2])
  end
  if status(entry) == $FOUND then
    if tonumber(ARGV[5]) > 0 then
      redis.call('SET', KEYS[3], entry, 'PX', ARGV[5])
    end
  else
    redis.call('DEL', KEYS[3])
  end
end
if publish then
  redis.call(ARGV[7], ARGV[4], payload)
end
local released = 0
if ours then
  redis.call('DEL', KEYS[2])
  released = 1
end
return {released, payload}
