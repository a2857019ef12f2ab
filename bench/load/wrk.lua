-- wrk script for bench/run. Configured through the environment, read when the script loads (so
-- that GET and list stay static requests, which wrk sends without calling into Lua):
--
--   BENCH_TOKEN   API token, sent as `Authorization: Bearer …`
--   BENCH_MODE    get | list | create
--   BENCH_PREFIX  create only: a random prefix that makes names unique across runs
--
-- Create posts a new dedicated inference per request, named PREFIX-THREAD-COUNTER and spread over
-- the three regions. `done` prints one line that bench/run parses:
--   RESULT rps=… p50_ms=… p99_ms=… requests=… non2xx=… socket_errors=…

local token = os.getenv("BENCH_TOKEN") or error("BENCH_TOKEN is not set")
local mode = os.getenv("BENCH_MODE") or "get"

wrk.headers["Authorization"] = "Bearer " .. token
wrk.headers["Accept"] = "application/json"

local threads = {}

function setup(thread)
   thread:set("thread_number", #threads + 1)
   table.insert(threads, thread)
end

if mode == "create" then
   local prefix = os.getenv("BENCH_PREFIX") or error("BENCH_PREFIX is not set")
   local regions = { "atl1", "nyc2", "tor1" }
   local counter = 0
   local body_format = '{"spec":{"version":1,"name":"%s","region":"%s",'
      .. '"vpc":null,"enable_public_endpoint":true,'
      .. '"model_deployments":[{"model_slug":"qwen/qwen2.5-7b-instruct","model_provider":"hugging_face",'
      .. '"workload_config":{},"accelerators":[{"scale":1,"type":"prefill_decode",'
      .. '"accelerator_slug":"gpu-h100x1-80gb"}]}]}}'
   -- wrk.format does not merge a headers table with wrk.headers: put everything in wrk.headers.
   wrk.headers["Content-Type"] = "application/json"

   function request()
      counter = counter + 1
      local name = string.format("%s-%d-%d", prefix, thread_number or 0, counter)
      local region = regions[counter % #regions + 1]
      return wrk.format("POST", nil, nil, string.format(body_format, name, region))
   end
elseif mode ~= "get" and mode ~= "list" then
   error("BENCH_MODE must be get, list or create, not " .. mode)
end

function done(summary, latency, requests)
   local seconds = summary.duration / 1e6
   local e = summary.errors
   io.write(string.format(
      "RESULT rps=%.1f p50_ms=%.3f p99_ms=%.3f requests=%d non2xx=%d socket_errors=%d\n",
      summary.requests / seconds,
      latency:percentile(50) / 1000,
      latency:percentile(99) / 1000,
      summary.requests,
      e.status,
      e.connect + e.read + e.write + e.timeout))
end
