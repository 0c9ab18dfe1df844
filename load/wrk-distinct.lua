-- wrk script: every request a different post, no id twice across wrk's
-- threads: a permutation of FIRST_ID .. FIRST_ID+RANGE-1. Request k of the
-- run is index k (thread t of THREADS takes t, t+THREADS, ...), and index i
-- is the post FIRST_ID + (OFFSET + i*STEP) mod RANGE, STEP coprime to RANGE
-- (`load/compare` picks one near RANGE/φ, so neighbouring requests land far
-- apart in the table, as a crawler's or a long tail's would). REVERSE=1 walks
-- the indices from the end, for a second run that meets none of the first's
-- ids. A thread that runs past its share of RANGE wraps, and the ids repeat:
-- the caller sizes RANGE above the requests a run can make. Used by
-- `load/compare cold-storm`.
local first = tonumber(os.getenv("FIRST_ID") or "1")
local range = tonumber(os.getenv("RANGE") or "1000000")
local step = tonumber(os.getenv("STEP") or "1")
local offset = tonumber(os.getenv("OFFSET") or "0")
local stride = tonumber(os.getenv("THREADS") or "1")
local reverse = os.getenv("REVERSE") == "1"
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("t", threads - 1)
end

local k = -1

request = function()
  k = k + 1
  local i = ((t or 0) + k * stride) % range
  if reverse then
    i = range - 1 - i
  end
  return wrk.format("GET", "/posts/" .. (first + (offset + i * step) % range))
end
