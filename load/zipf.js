// zipf.js: realistic popularity (Zipf over the seeded ids) at a constant
// arrival rate, with thresholds on latency and errors.
//
//   BASE_URLS    comma-separated instances (default http://127.0.0.1:8080)
//   RATE         requests per second (default 1000)
//   DURATION     how long (default 30s)
//   MAX_ID       ids 1..MAX_ID are seeded (default 100000)
//   ZIPF_S       Zipf exponent (default 1.1; larger = more skewed)
//   P95_MS, P99_MS latency thresholds (default 50 and 200)
//   SUMMARY_JSON where to write the JSON summary
import { check } from 'k6';
import { constantRate, getPost, summarize, trendStats } from './lib.js';
import { zipfSampler } from './zipf-sampler.js';

const maxId = parseInt(__ENV.MAX_ID || '100000', 10);
const s = parseFloat(__ENV.ZIPF_S || '1.1');

export const options = {
  scenarios: { zipf: constantRate(1000, '30s') },
  thresholds: {
    post_req_failed: ['rate<0.001'],
    post_req_duration: [`p(95)<${__ENV.P95_MS || 50}`, `p(99)<${__ENV.P99_MS || 200}`],
  },
  summaryTrendStats: trendStats,
};

// Exact Zipf(s) over 1..maxId (see zipf-sampler.js).
const zipfId = zipfSampler(maxId, s);

export default function () {
  const res = getPost(zipfId(), __ITER);
  check(res, { 'status 200': (r) => r.status === 200 });
}

export function handleSummary(data) {
  return summarize('zipf', data);
}
