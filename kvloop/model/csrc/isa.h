// A region of code built for one instruction set, inside a library built for the baseline:
//
//   KVLOOP_TARGET_BEGIN("avx2,fma")
//   namespace kvloop::avx2 { ... }
//   KVLOOP_TARGET_END
//
// Every function defined in the region (lambdas and templates included) may use that
// instruction set; code defined outside it (the standard library, c10, whatever the region
// calls or instantiates from a header included before it) stays baseline, so the linker can
// never pick a wide-vector copy of a shared inline function for the whole library. Each
// region's code lives in its own namespace: one variant's templates never merge with
// another's. Only the dispatcher (dispatch.cpp) decides whether a region's code runs.
#pragma once

#define KVLOOP_PRAGMA(x) _Pragma(#x)

#if defined(__clang__)
#define KVLOOP_TARGET_BEGIN(isa) \
  KVLOOP_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define KVLOOP_TARGET_END KVLOOP_PRAGMA(clang attribute pop)
#elif defined(__GNUC__)
#define KVLOOP_TARGET_BEGIN(isa) KVLOOP_PRAGMA(GCC push_options) KVLOOP_PRAGMA(GCC target(isa))
#define KVLOOP_TARGET_END KVLOOP_PRAGMA(GCC pop_options)
#else
#error "kvloop's CPU ops need GCC or Clang (per-function instruction-set targets)"
#endif

#if defined(__x86_64__) || defined(__i386__)
#define KVLOOP_X86 1
#endif
