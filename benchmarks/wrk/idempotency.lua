-- wrk script for the idempotency benchmarks: POST /orders with an Idempotency-Key per request.
-- Arguments (after "--"): mode, prefix, pool, stride
--   fresh:  a new key every request: <prefix>-<thread>-<counter>-<random>
--   replay: cycle through the primed keys <prefix>-0 .. <prefix>-(pool-1)
--   sample: a uniformly random stored key <prefix>-<n * stride> with n in [0, pool)
-- At the end it prints one line "WRKJSON {...}" with throughput, latency percentiles (microseconds), the count
-- of each status code and of replayed answers, and the first few unexpected answers (a replay on a fresh key, or
-- an answer that is not a replay on a stored key: status, header names, start of the body), for
-- benchmarks/loadgen.py to parse.

wrk.method = "POST"
wrk.body = '{"amount": 1250, "currency": "eur", "customer": "cus_42"}'

local threads = {}
local counter = 0
local mode, prefix, pool, stride  -- "tid" is a global, set per thread by setup()
statuses = {}  -- globals: done() reads them from each thread with thread:get()
replayed = 0
odd = ""  -- unexpected answers, as JSON objects separated by commas
local odd_count = 0
local headers = {
  ["Content-Type"] = "application/json",
  ["Authorization"] = "Bearer bench-token",
}

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  mode = args[1] or "fresh"
  prefix = args[2] or "k"
  pool = tonumber(args[3] or "1000")
  stride = tonumber(args[4] or "1")
  math.randomseed(os.time() * 1000 + tid)
end

function request()
  counter = counter + 1
  local key
  if mode == "replay" then
    key = prefix .. "-" .. (counter % pool)
  elseif mode == "sample" then
    key = prefix .. "-" .. (math.random(0, pool - 1) * stride)
  else
    key = string.format("%s-%d-%d-%08x", prefix, tid, counter, math.random(0, 0x7fffffff))
  end
  headers["Idempotency-Key"] = key
  return wrk.format(nil, nil, headers, nil)
end

local function json_string(text)
  text = string.gsub(text, '[%c"\\]', function(c) return string.format("\\u%04x", string.byte(c)) end)
  return '"' .. text .. '"'
end

function response(status, response_headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  local was_replay = response_headers["idempotent-replayed"] == "true"
    or response_headers["x-idempotent-replayed"] == "true"
  if was_replay then
    replayed = replayed + 1
  end
  if was_replay == (mode == "fresh") and odd_count < 3 then
    odd_count = odd_count + 1
    local names = {}
    for name, _ in pairs(response_headers) do
      table.insert(names, name)
    end
    odd = odd .. (odd == "" and "" or ", ") .. string.format('{"status": %d, "headers": %s, "body": %s}',
      status, json_string(table.concat(names, " ")), json_string(string.sub(body or "", 1, 200)))
  end
end

function done(summary, latency, requests)
  local by_status, total_replayed, odds = {}, 0, {}
  for _, thread in ipairs(threads) do
    local counts = thread:get("statuses")
    for status, n in pairs(counts) do
      by_status[tostring(status)] = (by_status[tostring(status)] or 0) + n
    end
    total_replayed = total_replayed + thread:get("replayed")
    local thread_odd = thread:get("odd")
    if thread_odd ~= "" then
      table.insert(odds, thread_odd)
    end
  end
  local parts = {}
  for status, n in pairs(by_status) do
    table.insert(parts, string.format('"%s": %d', status, n))
  end
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "errors": {"connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d}, "p50_us": %d, "p90_us": %d, "p99_us": %d, "p999_us": %d, "max_us": %d, ' ..
    '"mean_us": %.1f, "statuses": {%s}, "replayed": %d, "odd": [%s]}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.max, latency.mean, table.concat(parts, ", "), total_replayed, table.concat(odds, ", ")))
end
