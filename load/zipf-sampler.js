// zipf-sampler.js: ids 1..n drawn with exact Zipf(s) frequencies, as the
// test kit's sampler (src/testkit/load.rs) draws them: the cumulative
// weights 1/k^s are summed once, and each draw is a binary search for a
// uniform point in them. Plain JavaScript (no k6 import), so that
// `node load/zipf-check.mjs` checks it against the exact shares. The wrk
// script (wrk-zipf.lua) draws the same way.

export function zipfSampler(n, s, random = Math.random) {
  const cumulative = new Float64Array(n);
  let total = 0;
  for (let k = 1; k <= n; k++) {
    total += 1 / Math.pow(k, s);
    cumulative[k - 1] = total;
  }
  return function draw() {
    const x = random() * total;
    // The first k whose cumulative weight reaches x.
    let lo = 0;
    let hi = n - 1;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (cumulative[mid] < x) lo = mid + 1;
      else hi = mid;
    }
    return lo + 1;
  };
}
