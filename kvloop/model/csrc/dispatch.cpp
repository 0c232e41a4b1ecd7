// Which variant of the kernels runs: the variants in order of preference, each with the CPU
// features it needs, and the process's choice (the best one this CPU runs, unless
// `use_variant` names another). To add a variant: a file that fills a `Kernels` table
// (x86_avx2.cpp is the pattern), its getter in kernels.h, and one line in `kVariants`.
#include "isa.h"
#include "kernels.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvloop {
namespace {

bool always() { return true; }

#ifdef KVLOOP_X86
// __builtin_cpu_supports also asks the OS (XGETBV): a feature whose registers the kernel
// does not save counts as absent.
bool cpu_runs_avx2() {
  __builtin_cpu_init();          // (idempotent; needed where this runs before constructors)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_runs_avx512() {
  return cpu_runs_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

bool cpu_runs_avx512_bf16() {
  return cpu_runs_avx512() && __builtin_cpu_supports("avx512bf16");
}
#else
bool cpu_runs_avx2() { return false; }
bool cpu_runs_avx512() { return false; }
bool cpu_runs_avx512_bf16() { return false; }
#endif

const Kernels* generic_table() { return &generic_kernels(); }

// Best first. `needs` names the features as /proc/cpuinfo spells them.
const std::vector<Variant> kVariants = {
    {"avx512_bf16", "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16",
     avx512_bf16_kernels, cpu_runs_avx512_bf16},
    {"avx512", "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_vnni", avx512_kernels,
     cpu_runs_avx512},
    {"avx2", "avx2 fma", avx2_kernels, cpu_runs_avx2},
    {"generic", "", generic_table, always},
};

bool runs_here(const Variant& v) { return v.kernels() != nullptr && v.cpu_runs(); }

const Kernels* best() {
  for (const Variant& v : kVariants)
    if (runs_here(v)) return v.kernels();
  return &generic_kernels();
}

std::atomic<const Kernels*>& chosen() {
  static std::atomic<const Kernels*> table{best()};
  return table;
}

}  // namespace

const std::vector<Variant>& variants() { return kVariants; }

const Kernels& active_kernels() { return *chosen().load(std::memory_order_acquire); }

void use_variant(const char* name) {
  for (const Variant& v : kVariants) {
    if (std::strcmp(v.name, name) != 0) continue;
    if (v.kernels() == nullptr)
      throw std::runtime_error(std::string("CPU kernels '") + name +
                               "' are not built for this architecture");
    if (!v.cpu_runs())
      throw std::runtime_error(std::string("this CPU cannot run the '") + name +
                               "' kernels (they need: " + v.needs + ")");
    chosen().store(v.kernels(), std::memory_order_release);
    return;
  }
  throw std::invalid_argument(std::string("no CPU kernels named '") + name + "'");
}

}  // namespace kvloop
