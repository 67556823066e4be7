// The host floating-point mode of the cpu backend, the fp64 reference and the
// generator: IEEE subnormals, whatever mode the caller left the thread in.
// Flush-to-zero / denormals-are-zero (set by -ffast-math code, or by
// torch.set_flush_denormal(True)) would read subnormal inputs as 0: an
// index_score of 3.8e-44, which is >= eps = exp(-100), would then be masked out
// of stage 1 and every gradient of its row would change (docs/math.md).
// x86-64: MXCSR's FTZ and DAZ bits; aarch64: FPCR's FZ bit; elsewhere nothing.
#pragma once

#if defined(__x86_64__) || defined(__SSE2__) || defined(_M_X64)
#include <xmmintrin.h>
#define DSAIB_HOST_HAS_MXCSR 1
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <cstdint>
#define DSAIB_HOST_HAS_FPCR 1
#endif

namespace dsaib::detail {

/// Clears the calling thread's flush-to-zero (and, on x86-64, denormals-are-
/// zero) mode for its lifetime, then restores the caller's mode; the sticky
/// exception flags raised meanwhile are kept. Threads started meanwhile inherit
/// the cleared mode; run_items_on_threads also sets it in each of them.
class IeeeSubnormalsScope {
 public:
  IeeeSubnormalsScope() {
#if defined(DSAIB_HOST_HAS_MXCSR)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero));
#elif defined(DSAIB_HOST_HAS_FPCR)
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t cleared = saved_ & ~kFpcrFlushToZero;
    asm volatile("msr fpcr, %0" : : "r"(cleared));
#endif
  }
  ~IeeeSubnormalsScope() {
#if defined(DSAIB_HOST_HAS_MXCSR)
    _mm_setcsr(saved_ | (_mm_getcsr() & kExceptionFlags));  // the mode back, the flags raised kept
#elif defined(DSAIB_HOST_HAS_FPCR)
    asm volatile("msr fpcr, %0" : : "r"(saved_));  // FPCR holds the mode only (flags live in FPSR)
#endif
  }
  IeeeSubnormalsScope(const IeeeSubnormalsScope&) = delete;
  IeeeSubnormalsScope& operator=(const IeeeSubnormalsScope&) = delete;

 private:
#if defined(DSAIB_HOST_HAS_MXCSR)
  static constexpr unsigned kFlushToZero = 0x8000u, kDenormalsAreZero = 0x0040u, kExceptionFlags = 0x003Fu;
  unsigned saved_ = 0;
#elif defined(DSAIB_HOST_HAS_FPCR)
  static constexpr uint64_t kFpcrFlushToZero = uint64_t{1} << 24;
  uint64_t saved_ = 0;
#endif
};

}  // namespace dsaib::detail
