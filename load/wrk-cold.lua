-- wrk script: every request a different post, ids FIRST_ID, FIRST_ID+1, ...
-- (one wrk thread: -t1), so that each read is a cold miss on a fresh
-- KEY_PREFIX. Used by `load/compare readyz-flood`.
local id = tonumber(os.getenv("FIRST_ID") or "1") - 1

request = function()
  id = id + 1
  return wrk.format("GET", "/posts/" .. id)
end
