// Shared helpers of the postcache k6 scripts.
import http from 'k6/http';
import { Counter, Rate, Trend } from 'k6/metrics';

// BASE_URLS: comma-separated instances; requests are spread across them.
export const bases = (__ENV.BASE_URLS || 'http://127.0.0.1:8080')
  .split(',')
  .map((s) => s.trim().replace(/\/$/, ''))
  .filter((s) => s.length > 0);

// Responses counted by how postcache served them (the X-Cache header).
const served = {
  hit: new Counter('xcache_hit'),
  miss: new Counter('xcache_miss'),
  coalesced: new Counter('xcache_coalesced'),
  stale: new Counter('xcache_stale'),
  bypass: new Counter('xcache_bypass'),
  none: new Counter('xcache_none'),
};

// The post requests alone (warm-up requests to /healthz are not in them).
const postDuration = new Trend('post_req_duration', true);
const postFailed = new Rate('post_req_failed');

// GET /posts/{id} on the instance chosen by `n`, counting X-Cache.
export function getPost(id, n) {
  const base = bases[n % bases.length];
  const res = http.get(`${base}/posts/${id}`, { tags: { name: 'GET /posts/{id}' } });
  const tag = res.headers['X-Cache'] || res.headers['x-cache'] || 'none';
  (served[tag] || served.none).add(1);
  postDuration.add(res.timings.duration);
  postFailed.add(res.status !== 200);
  return res;
}

// A scenario of RATE requests a second (default `rate`) for DURATION
// (default `duration`), whatever the latency: up to 2000 VUs are started
// to hold the rate. `extra` adds to it (a startTime, say).
export function constantRate(rate, duration, extra = {}) {
  const perSecond = parseInt(__ENV.RATE || rate, 10);
  return Object.assign(
    {
      executor: 'constant-arrival-rate',
      rate: perSecond,
      timeUnit: '1s',
      duration: __ENV.DURATION || duration,
      preAllocatedVUs: Math.min(perSecond, 500),
      maxVUs: 2000,
    },
    extra,
  );
}

// Percentiles reported in the JSON summary.
export const trendStats = ['avg', 'min', 'med', 'max', 'p(50)', 'p(90)', 'p(95)', 'p(99)'];

// handleSummary: JSON to SUMMARY_JSON (default summary-<name>.json) and a short text.
export function summarize(name, data) {
  const d = data.metrics.post_req_duration ? data.metrics.post_req_duration.values : {};
  const failedRate = data.metrics.post_req_failed ? data.metrics.post_req_failed.values : null;
  const failed = failedRate ? failedRate.rate : 0;
  const reqs = failedRate ? failedRate.passes + failedRate.fails : 0;
  const count = (m) => (data.metrics[m] ? data.metrics[m].values.count : 0);
  const mix = ['hit', 'miss', 'coalesced', 'stale', 'bypass', 'none']
    .map((t) => `${t}=${count('xcache_' + t)}`)
    .join(' ');
  const fmt = (v) => (v === undefined ? '-' : v.toFixed(2));
  const text =
    `${name}: ${reqs} requests, failed ${(failed * 100).toFixed(2)}%, ` +
    `p50 ${fmt(d['p(50)'])} ms, p95 ${fmt(d['p(95)'])} ms, p99 ${fmt(d['p(99)'])} ms; X-Cache ${mix}\n`;
  const out = { stdout: text };
  out[__ENV.SUMMARY_JSON || `summary-${name}.json`] = JSON.stringify(data, null, 2);
  return out;
}
