// Scatter role (warpgroup 3): adds every dK block the dK role stages into the
// global dK accumulator, one float4 red per lane on contiguous columns of a key
// row (a whole 512-B row per warp instruction at D=128), until the end marker.
// kL2KeepDk: the reds carry an L2 policy (l2_policy.cuh); kFixedPointDk: int64
// fixed-point terms instead (fixed_point_dk.cuh).
#pragma once

#include <cute/config.hpp>

#include "hopper/indexer_backward/fixed_point_dk.cuh"
#include "hopper/indexer_backward/l2_policy.cuh"
#include "hopper/common/pipeline.cuh"
#include "hopper/common/shared_storage.cuh"

namespace dsaib::hopper {

template <class Config>
struct ScatterReduce {
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kLanesPerRow = kD / 4;
  static constexpr int kRowsPerStep = 32 / kLanesPerRow;
  static constexpr int kSteps = 16 / kRowsPerStep;
  // Warp w covers its 16 staged rows whole: kRowsPerStep rows per step, every lane busy.
  static_assert(kLanesPerRow * kRowsPerStep == 32 && kSteps * kRowsPerStep == 16,
                "a warp's steps cover rows 16w..16w+15, all D columns");
  static_assert(Config::kThreadsPerWarpgroup / 32 * 16 == Config::kBlockKeys, "4 warps x 16 rows = the staged block");

  const IndexerParams& p;
  SharedStorage<Config>& ss;
  MbarrierPipeline<Config::kDkBuffers> dk_pipe;  // this role empties the staging buffers

  /// The deterministic reds: one u64 red per element, lane li of a row on columns
  /// li + kLanesPerRow * j, so that each instruction covers whole sectors.
  template <class State>
  __device__ __forceinline__ void fixed_point_reds(State& state, int b, int lane, int row0) {
    const int li = lane % kLanesPerRow;
    int32_t kr[kSteps];
    float f[kSteps][4];
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      kr[s] = ss.dk_key_row[b][row0 + s * kRowsPerStep];
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) f[s][j] = ss.dk_stage[b][row0 + s * kRowsPerStep][li + kLanesPerRow * j];
    }
    dk_pipe.consumer_release(state);  // this thread's loads of buffer b are done
    state.advance();
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      if (kr[s] < 0) continue;
      unsigned long long* dst = p.dk_fixed + static_cast<int64_t>(kr[s]) * kD + li;
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) atomicAdd(dst + kLanesPerRow * j, dk_fixed_term(f[s][j], dk_scale));
    }
  }

  double dk_scale = 0.0;  // 2^E of the fixed-point terms (kFixedPointDk only; run() sets it)

  __device__ void run() {
    const int tid = threadIdx.x % Config::kThreadsPerWarpgroup;
    const int warp = tid / 32, lane = tid % 32;
    const int col = 4 * (lane % kLanesPerRow);
    const int row0 = 16 * warp + lane / kLanesPerRow;
    auto state = make_consumer_start_state<Config::kDkBuffers>();
    [[maybe_unused]] uint64_t dk_policy = 0;  // the reds' L2 policy (kL2KeepDk only)
    if constexpr (Config::kL2KeepDk) dk_policy = l2_policy_dk_reds(p.l2_keep_fraction);
    // *p.dk_bound: written by the bound pass before this kernel (stream order).
    if constexpr (Config::kFixedPointDk) dk_scale = ldexp(1.0, dk_fixed_exponent(*p.dk_bound, p.num_q_rows));
    for (;;) {
      dk_pipe.consumer_wait(state);
      const int b = state.index;
      if (ss.dk_end[b]) return;  // the dK role is done; nothing is left to read
      if constexpr (Config::kFixedPointDk) {
        fixed_point_reds(state, b, lane, row0);
      } else {
        int32_t kr[kSteps];
        float4 v[kSteps];
        CUTE_UNROLL
        for (int s = 0; s < kSteps; ++s) {
          kr[s] = ss.dk_key_row[b][row0 + s * kRowsPerStep];
          v[s] = *reinterpret_cast<const float4*>(&ss.dk_stage[b][row0 + s * kRowsPerStep][col]);
        }
        dk_pipe.consumer_release(state);  // this thread's loads of buffer b are done
        state.advance();
        CUTE_UNROLL
        for (int s = 0; s < kSteps; ++s) {
          if constexpr (Config::kL2KeepDk) {  // the same red with an L2 policy (l2_policy.cuh)
            if (kr[s] >= 0) red_add_f32x4(p.dk_accum + static_cast<int64_t>(kr[s]) * kD + col, v[s], dk_policy);
            continue;
          }
          if (kr[s] >= 0) atomicAdd(reinterpret_cast<float4*>(p.dk_accum + static_cast<int64_t>(kr[s]) * kD + col), v[s]);
        }
      }
    }
  }
};

}  // namespace dsaib::hopper
