// swr.js: one hot post under constant load with stale-while-revalidate on.
// Run the service with a short CACHE_TTL and STALE_WHILE_REVALIDATE, e.g.
// CACHE_TTL=1s STALE_WHILE_REVALIDATE=10s. After the first request, no request
// should wait for a load (X-Cache stays hit or stale, never miss).
//
//   BASE_URLS    comma-separated instances (default http://127.0.0.1:8080)
//   RATE         requests per second (default 500)
//   DURATION     how long (default 20s)
//   POST_ID      the hot post (default 1)
//   SUMMARY_JSON where to write the JSON summary
import { check } from 'k6';
import { constantRate, getPost, summarize, trendStats } from './lib.js';

const id = __ENV.POST_ID || '1';

export const options = {
  scenarios: { swr: constantRate(500, '20s', { startTime: '1s' }) },
  thresholds: {
    post_req_failed: ['rate==0'],
    // At most the warm-up request (and one per instance) waits for a load.
    xcache_miss: ['count<=1'],
    post_req_duration: ['p(99)<100'],
  },
  summaryTrendStats: trendStats,
};

export function setup() {
  getPost(id, 0); // warm the key
}

export default function () {
  const res = getPost(id, __ITER);
  check(res, { 'status 200': (r) => r.status === 200 });
}

export function handleSummary(data) {
  return summarize('swr', data);
}
