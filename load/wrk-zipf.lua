-- wrk script: GET /posts/{id} with Zipf-distributed ids over 1..MAX_ID.
-- MAX_ID and ZIPF_S come from the environment (defaults 100000 and 1.1).
local max_id = tonumber(os.getenv("MAX_ID") or "100000")
local s = tonumber(os.getenv("ZIPF_S") or "1.1")
local a = 1 - s

math.randomseed(os.time() + tonumber(tostring({}):sub(8), 16))

request = function()
  local u = math.random()
  local x = ((max_id + 1) ^ a - 1) * u + 1
  local id = math.floor(x ^ (1 / a))
  if id < 1 then id = 1 elseif id > max_id then id = max_id end
  return wrk.format("GET", "/posts/" .. id)
end
