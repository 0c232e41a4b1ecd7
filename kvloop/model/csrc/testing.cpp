// Test hooks of kvloop's thread pool (pool.h), kept out of the ops' file: tests/test_cpu_ops.py
// calls them through the extension module (`pool_run_ids`, `pool_stress`).
#include <torch/extension.h>

#include "pool.h"

#include <atomic>
#include <vector>

namespace {

// fn(i) for i in [0, n) on the pool, counting the runs of each (tests of the pool: fails
// unless each ran exactly once).
at::Tensor pool_run_ids(int64_t n) {
  std::vector<std::atomic<int64_t>> hits(n);
  kvloop::Pool::get().run(n, [&](int64_t i) { hits[i].fetch_add(1); });
  auto out = at::empty({n}, at::kLong);
  int64_t* runs = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    runs[i] = hits[i].load();
    TORCH_CHECK(runs[i] == 1, "pool ran chunk ", i, " ", runs[i], " times");
  }
  return out;
}

// `jobs` jobs of alternately few and many chunks back to back (a worker still leaving one
// job while the next is published: the pool's hardest case), each chunk counted; returns
// how many chunks ran other than exactly once (0), or never returns if a job is lost.
int64_t pool_stress(int64_t jobs) {
  constexpr int64_t kSizes[] = {2, 37, 3, 64, 5, 19};
  std::vector<std::atomic<int64_t>> hits(64);
  int64_t wrong = 0;
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t n = kSizes[j % 6];
    for (int64_t i = 0; i < n; ++i) hits[i].store(0, std::memory_order_relaxed);
    kvloop::Pool::get().run(n, [&](int64_t i) { hits[i].fetch_add(1); });
    for (int64_t i = 0; i < n; ++i) wrong += hits[i].load() != 1;
  }
  return wrong;
}

}  // namespace

void register_pool_tests(pybind11::module& m) {
  m.def("pool_run_ids", &pool_run_ids, "run n chunks on the pool; the runs of each (tests)");
  m.def("pool_stress", &pool_stress, "jobs of mixed sizes back to back; chunks run wrongly");
}
