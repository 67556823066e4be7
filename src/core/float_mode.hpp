// The host floating-point mode of the cpu backend, the fp64 reference and the
// generator: IEEE subnormals, whatever mode the caller left the thread in.
// Flush-to-zero / denormals-are-zero (set by -ffast-math code, or by
// torch.set_flush_denormal(True)) would read subnormal inputs as 0: an
// index_score of 3.8e-44, which is >= eps = exp(-100), would then be masked out
// of stage 1 and every gradient of its row would change (docs/math.md).
#pragma once

#if defined(__x86_64__) || defined(__SSE2__)
#include <xmmintrin.h>
#define DSAIB_HOST_HAS_MXCSR 1
#endif

namespace dsaib::detail {

/// Clears the SSE flush-to-zero and denormals-are-zero bits (MXCSR) of the
/// calling thread for its lifetime, then restores the caller's MXCSR. Threads
/// started meanwhile inherit the cleared mode; run_items_on_threads also sets it
/// in each of them. No effect on targets without MXCSR.
class IeeeSubnormalsScope {
 public:
  IeeeSubnormalsScope() {
#ifdef DSAIB_HOST_HAS_MXCSR
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero));
#endif
  }
  ~IeeeSubnormalsScope() {
#ifdef DSAIB_HOST_HAS_MXCSR
    _mm_setcsr(saved_);
#endif
  }
  IeeeSubnormalsScope(const IeeeSubnormalsScope&) = delete;
  IeeeSubnormalsScope& operator=(const IeeeSubnormalsScope&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 0x8000u, kDenormalsAreZero = 0x0040u;
  [[maybe_unused]] unsigned saved_ = 0;
};

}  // namespace dsaib::detail
