#include <cstdio>
#include <cute/tensor.hpp>
#include "hopper/tile_config.cuh"
using namespace cute;
template <int D> int check() {
  using Config = dsaib::hopper::TileConfig<D, false>;
  typename Config::TiledMmaDKt mma;
  int bad = 0;
  for (int tid = 0; tid < 128; ++tid) {
    auto thr = mma.get_thread_slice(tid);
    Tensor id = make_identity_tensor(Shape<Int<D>, Int<64>>{});
    Tensor c = thr.partition_C(id);  // (MMA, MMA_M, MMA_N)
    const int warp = tid / 32, lane = tid % 32, r0 = 16 * warp + lane / 4, c0 = 2 * (lane % 4);
    for (int mi = 0; mi < D / 64; ++mi)
      for (int i = 0; i < 32; ++i) {
        auto crd = c(i, mi, 0);
        const int d = 64 * mi + r0 + 8 * ((i / 2) % 2), key = c0 + (i % 2) + 8 * (i / 4);
        if (get<0>(crd) != d || get<1>(crd) != key) {
          if (bad < 5) printf("D%d tid %d mi %d i %d: cute (%d,%d) formula (%d,%d)\n", D, tid, mi, i, (int)get<0>(crd), (int)get<1>(crd), d, key);
          ++bad;
        }
      }
    // A fragment (Q^T): the copy's destination view covers the same coordinates as the MMA's A partition
    Tensor idA = make_identity_tensor(Shape<Int<D>, Int<64>>{});
    Tensor a = thr.partition_A(idA);
    auto cpy = make_tiled_copy_A(Copy_Atom<SM75_U16x8_LDSM_T, typename Config::Element>{}, mma);
    auto tc = cpy.get_thread_slice(tid);
    Tensor s = tc.partition_S(idA);
    if (size(s) != size(a)) { printf("size mismatch %d %d\n", int(size(s)), int(size(a))); ++bad; }
  }
  printf("D%d: %d mismatches\n", D, bad);
  return bad;
}
int main() { return check<128>() + check<64>(); }
