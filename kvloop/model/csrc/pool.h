// kvloop's thread pool for the low-bit decode path (see cpu_ops.cpp: the quantized matmuls
// and `DecodeStack` run on it; everything else keeps torch's OpenMP team).
//
// Why not OpenMP: kvloop sets GOMP_SPINCOUNT low (an idle OpenMP thread must not hold a core
// another process wants), so between two of a decode step's ~150 small parallel regions
// torch's threads fall asleep and every region pays a futex wake-up, which on a VM's vCPUs
// costs more than the region saves (measured: a decode step took 21 ms serial, 30-44 ms with
// its matmuls on OpenMP). This pool instead:
// - lets the caller take part: `run(n, fn)` publishes n chunks and the caller claims chunks
//   like any worker, so it never waits for a worker that has not started (one that is
//   asleep or descheduled simply gets fewer chunks); it waits only for chunks in progress;
// - keeps its workers spinning for a short while after each job (`spin_us`, default
//   kDefaultSpinUs, env KVLOOP_POOL_SPIN_US), yielding the core after the first part of it,
//   then sleeping on a condition variable until the next job.
// One caller at a time: a second thread calling `run` meanwhile runs its chunks serially.
// A forked child rebuilds the pool (its workers did not survive the fork).
// Resizing (`get(n)`, at start-up) must not race a `run` on the same pool.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvloop {

constexpr int64_t kDefaultSpinUs = 2000;
constexpr int64_t kPauseSpinUs = 50;   // pure spinning before the waiter starts yielding

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  using Fn = std::function<void(int64_t)>;

  // The process's pool with `threads` threads in all (caller included), built on first use
  // and again when `threads` changes (threads < 1: keep the current size). After a fork the
  // child builds a fresh one (its workers did not survive: the old one is leaked). Without
  // a resize the pool is read from an atomic pointer: no lock, no system call per job.
  static Pool& get(int threads = 0) {
    if (threads < 1) {
      if (Pool* pool = current().load(std::memory_order_acquire)) return *pool;
    }
    static std::mutex guard;
    std::lock_guard<std::mutex> lock(guard);
    static std::once_flag at_fork;
    std::call_once(at_fork, [] {
      pthread_atfork(nullptr, nullptr, [] { current().store(nullptr); });
    });
    Pool* pool = current().load(std::memory_order_acquire);
    if (threads < 1) threads = pool ? pool->threads() : default_threads();
    if (!pool || pool->threads() != threads) {
      Pool* fresh = new Pool(threads);
      current().store(fresh, std::memory_order_release);
      delete pool;                 // joins its workers; set at start-up, not mid-step
      pool = fresh;
    }
    return *pool;
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(i) for every i in [0, n), each exactly once, on the caller and the workers; returns
  // when all are done.
  void run(int64_t n, const Fn& fn) {
    std::unique_lock<std::mutex> one_caller(run_lock_, std::try_to_lock);
    if (n <= 1 || workers_.empty() || !one_caller.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    // Close the last job before changing what its chunks refer to: a worker still in it may
    // hold a stale state (old generation, next chunk) that it checked against the new n_
    // (larger than the old one); its claim, a CAS on that state, now fails. (Without this,
    // such a claim ran a chunk of the new job with the old state and counted it twice: the
    // caller then waited forever for done_ to equal n.) The closed state has a generation of
    // its own, so a worker that sees it still finds the job that follows new.
    state_.store((++generation_ << 32) | kClosed, std::memory_order_seq_cst);
    done_.store(0, std::memory_order_relaxed);
    fn_.store(&fn, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    const uint64_t gen = ++generation_;
    state_.store(gen << 32, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_lock_);
      wake_.notify_all();
    }
    work(gen);
    wait_until([&] { return done_.load(std::memory_order_acquire) == n; });
  }

  ~Pool() {
    stop_.store(true, std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> lock(sleep_lock_);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

 private:
  static std::atomic<Pool*>& current() {
    static std::atomic<Pool*> pool{nullptr};
    return pool;
  }

  explicit Pool(int threads) : spin_us_(spin_from_env()) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  static int default_threads() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1u, std::thread::hardware_concurrency());
  }

  static int64_t spin_from_env() {
    const char* v = std::getenv("KVLOOP_POOL_SPIN_US");
    return v ? std::max<int64_t>(0, std::atoll(v)) : kDefaultSpinUs;
  }

  static constexpr uint64_t kClosed = 0xffffffffu;   // a next chunk past any job's end
  static uint64_t gen_of(uint64_t s) { return s >> 32; }
  static int64_t index_of(uint64_t s) { return static_cast<int64_t>(s & 0xffffffffu); }

  // Claim and run chunks of job `gen` until none is left. A claim is a CAS on (gen, next):
  // when it succeeds the job is still `gen` and unfinished, so fn_ and n_ (written before
  // `gen` was published, changed only after all its chunks are done) are that job's.
  void work(uint64_t gen) {
    while (true) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if (gen_of(s) != gen || index_of(s) >= n_.load(std::memory_order_relaxed)) return;
      const Fn* fn = fn_.load(std::memory_order_relaxed);
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      (*fn)(index_of(s));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // Spin (pause, then yield) until `ready()`; the caller's wait for chunks in progress.
  template <typename Ready>
  static void wait_until(Ready ready) {
    const auto start = std::chrono::steady_clock::now();
    while (!ready()) {
      if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(kPauseSpinUs))
        cpu_relax();
      else
        std::this_thread::yield();
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    while (!stop_.load(std::memory_order_acquire)) {
      if (!await_job(seen)) return;
      seen = gen_of(state_.load(std::memory_order_acquire));
      work(seen);
    }
  }

  // Wait for a job newer than `seen`: spin up to spin_us_, then sleep. False on stop.
  bool await_job(uint64_t seen) {
    auto fresh = [&] {
      return gen_of(state_.load(std::memory_order_seq_cst)) != seen ||
             stop_.load(std::memory_order_seq_cst);
    };
    const auto start = std::chrono::steady_clock::now();
    while (!fresh()) {
      const auto spent = std::chrono::steady_clock::now() - start;
      if (spent < std::chrono::microseconds(std::min(kPauseSpinUs, spin_us_))) {
        cpu_relax();
      } else if (spent < std::chrono::microseconds(spin_us_)) {
        std::this_thread::yield();
      } else {
        std::unique_lock<std::mutex> lock(sleep_lock_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, fresh);
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
    return !stop_.load(std::memory_order_acquire);
  }

  const int64_t spin_us_;
  std::vector<std::thread> workers_;
  std::mutex run_lock_;
  uint64_t generation_ = 0;                  // written by the caller only
  std::atomic<uint64_t> state_{0};           // (generation << 32) | next chunk
  std::atomic<int64_t> n_{0};
  std::atomic<const Fn*> fn_{nullptr};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_lock_;
  std::condition_variable wake_;
};

// fn(begin, end) over [0, n) in chunks of `chunk` items on the pool.
inline void pool_for(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  Pool::get().run(chunks, [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); });
}

}  // namespace kvloop
