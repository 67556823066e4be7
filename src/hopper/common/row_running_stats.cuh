// A row's running softmax statistics, as the loss forward's score role and the
// loss-and-gradient kernel's dK role accumulate them block by block.
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// Running max m of the logits z and sum s of exp(z - m), the smallest z, the
/// fp64 sums of T~ z and T~, over a part of a row's valid slots.
struct RowRunningStats {
  float m, s, z_min;
  double target_logit, target;
  int32_t count;  // valid slots
};

}  // namespace dsaib::hopper
