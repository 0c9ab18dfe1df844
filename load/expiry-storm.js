// expiry-storm.js: a constant arrival rate on a small hot set whose entries
// expire under load. Run the service with a short CACHE_TTL (e.g. 2s).
//
//   BASE_URLS    comma-separated instances (default http://127.0.0.1:8080)
//   RATE         requests per second (default 500)
//   DURATION     how long (default 20s)
//   HOT_KEYS     size of the hot set (default 20)
//   FIRST_ID     first id of the hot set (default: a new block per run)
//   MAX_ID       ids 1..MAX_ID are seeded (default 100000)
//   SUMMARY_JSON where to write the JSON summary
import { check } from 'k6';
import { constantRate, getPost, summarize, trendStats } from './lib.js';

const hot = parseInt(__ENV.HOT_KEYS || '20', 10);

export const options = {
  scenarios: { storm: constantRate(500, '20s') },
  thresholds: { post_req_failed: ['rate<0.01'] },
  summaryTrendStats: trendStats,
};

export function setup() {
  const maxId = parseInt(__ENV.MAX_ID || '100000', 10);
  const first = __ENV.FIRST_ID
    ? parseInt(__ENV.FIRST_ID, 10)
    : ((Math.floor(Date.now() / 1000) * hot) % (maxId - hot)) + 1;
  return { first };
}

export default function (data) {
  const id = data.first + Math.floor(Math.random() * hot);
  const res = getPost(id, __ITER);
  check(res, { 'status 200': (r) => r.status === 200 });
}

export function handleSummary(data) {
  return summarize('expiry-storm', data);
}
