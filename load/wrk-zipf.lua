-- wrk script: GET /posts/{id} with Zipf-distributed ids over 1..MAX_ID.
-- MAX_ID and ZIPF_S come from the environment (defaults 100000 and 1.1).
-- Exact Zipf(s), drawn as the test kit and zipf-sampler.js draw it: the
-- cumulative weights 1/k^s are summed once per thread, and each draw is a
-- binary search for a uniform point in them (load/zipf-check checks the
-- shares against the exact formula).
local max_id = tonumber(os.getenv("MAX_ID") or "100000")
local s = tonumber(os.getenv("ZIPF_S") or "1.1")

local cumulative = {}
local total = 0
for k = 1, max_id do
  total = total + 1 / k ^ s
  cumulative[k] = total
end

local function zipf_id()
  local x = math.random() * total
  -- The first k whose cumulative weight reaches x.
  local lo, hi = 1, max_id
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cumulative[mid] < x then lo = mid + 1 else hi = mid end
  end
  return lo
end

math.randomseed(os.time() + tonumber(tostring({}):sub(8), 16))

-- `zipf_id` for load/zipf-check, which runs this file outside wrk.
zipf = zipf_id

request = function()
  return wrk.format("GET", "/posts/" .. zipf_id())
end
