-- wrk script: every request a post drawn uniformly from FIRST_ID ..
-- FIRST_ID+RANGE-1, each wrk thread with its own generator. On a fresh
-- KEY_PREFIX nearly every read is a cold miss. Used by `load/compare
-- cold-storm`.
local first = tonumber(os.getenv("FIRST_ID") or "1")
local range = tonumber(os.getenv("RANGE") or "200000")
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("n", threads)
end

function init(args)
  math.randomseed(os.time() * 1000 + (n or 0) * 7919)
end

request = function()
  return wrk.format("GET", "/posts/" .. (first + math.random(0, range - 1)))
end
