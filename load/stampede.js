// stampede.js: N virtual users, one request each, released together on one
// cold post. Run the service with any CACHE_TTL; the post id is fresh per run.
//
//   BASE_URLS   comma-separated instances (default http://127.0.0.1:8080)
//   VUS         concurrent requests (default 1000)
//   MAX_ID      ids 1..MAX_ID are seeded (default 100000)
//   POST_ID     force the post id (default: a new one per run, from the clock)
//   RELEASE_MS  how long after setup all requests are released together
//               (default 3000: every VU connects first, then waits for it)
//   SUMMARY_JSON where to write the JSON summary (default summary-stampede.json)
//
//   k6 run -e BASE_URLS=http://127.0.0.1:8080,http://127.0.0.1:8081 load/stampede.js
import { check, sleep } from 'k6';
import http from 'k6/http';
import { bases, getPost, summarize, trendStats } from './lib.js';

const vus = parseInt(__ENV.VUS || '1000', 10);

export const options = {
  scenarios: {
    stampede: { executor: 'per-vu-iterations', vus, iterations: 1, maxDuration: '60s' },
  },
  thresholds: { post_req_failed: ['rate==0'], checks: ['rate==1'] },
  summaryTrendStats: trendStats,
};

export function setup() {
  const maxId = parseInt(__ENV.MAX_ID || '100000', 10);
  // A different id every run (and every second), so reruns stay cold.
  const id = __ENV.POST_ID || (Math.floor(Date.now() / 1000) % maxId) + 1;
  const releaseAt = Date.now() + parseInt(__ENV.RELEASE_MS || '3000', 10);
  return { id, releaseAt };
}


export default function (data) {
  // Open this VU's connection first, then wait for the common release instant.
  http.get(`${bases[(__VU - 1) % bases.length]}/healthz`);
  sleep(Math.max(0, (data.releaseAt - Date.now()) / 1000));
  const res = getPost(data.id, __VU - 1);
  check(res, { 'status 200': (r) => r.status === 200 });
}

export function handleSummary(data) {
  return summarize('stampede', data);
}
