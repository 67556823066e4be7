// A row's running softmax statistics, as the loss forward's score role and the
// loss-and-gradient kernel's dK role accumulate them block by block.
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// One part of a row's statistics over its valid slots, in the order the
/// blocks arrive: the running max m of the logits z and sum s of exp(z - m)
/// (a -inf logit adds nothing), the smallest z, the fp64 sums of T~ z and of
/// T~, and the number of valid slots.
struct RowRunningStats {
  float m, s, z_min;
  double target_logit, target;
  int32_t count;  // valid slots
};

}  // namespace dsaib::hopper
