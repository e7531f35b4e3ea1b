-- wrk script: POST one small non-streaming chat completion per request.
--
--   BENCH_ROLLOUTS=fresh BENCH_ROLLOUT_ID=bench wrk -t1 -c32 -d10s --latency -s bench/wrk_chat.lua http://127.0.0.1:8000
--
-- With BENCH_API_KEY set (and not empty), every request carries `Authorization: Bearer <key>` (a gateway
-- started with `--auth required`); without it, no Authorization header at all.
--
-- At the end it prints one line "BENCH_JSON {...}" (counts, errors, latency in
-- microseconds) that bench/gateway_overhead.py parses.

wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.body = '{"model":"my-agent","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'
wrk.headers["Content-Type"] = "application/json"
-- BENCH_ROLLOUTS says which rollout each call names: "long" (the default: every call BENCH_ROLLOUT_ID, one
-- rollout), "fresh" (a new one per call: BENCH_ROLLOUT_ID-1, -2, ...: a rollout the gateway has not seen) or
-- "none" (no X-ART-Rollout-Id: the gateway makes one up).
local rollouts = os.getenv("BENCH_ROLLOUTS") or "long"
local rollout_id = os.getenv("BENCH_ROLLOUT_ID") or "bench"
if rollouts == "long" then
   wrk.headers["X-ART-Rollout-Id"] = rollout_id
elseif rollouts == "fresh" then
   local calls = 0
   request = function()
      calls = calls + 1
      wrk.headers["X-ART-Rollout-Id"] = rollout_id .. "-" .. calls
      return wrk.format()
   end
end
local api_key = os.getenv("BENCH_API_KEY")
if api_key and api_key ~= "" then
   wrk.headers["Authorization"] = "Bearer " .. api_key
end

done = function(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'BENCH_JSON {"duration_us":%d,"requests":%d,"bytes":%d,' ..
      '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,' ..
      '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,"mean_us":%.1f,"max_us":%d}\n',
      summary.duration, summary.requests, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
      latency.mean, latency.max))
end
