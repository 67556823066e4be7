// validate_indexer_kl_loss_inputs: indexer_backward()'s checks of the inputs
// and the options, without outputs.
#include "api/cuda_backend.hpp"
#include "core/problem.hpp"
#include "dsaib/indexer_backward.hpp"

namespace dsaib {

void validate_indexer_kl_loss_inputs(const IndexerInputs& inputs, const IndexerOptions& options) {
  IndexerInputs in = inputs;
  // An absent P (and no P-free row statistics) is checked as the caller's
  // future P: same dtype and shape as T.
  if (!in.index_score.present() && !in.row_lse.present() && !in.row_target_mass.present()) {
    in.index_score = in.attn_score;
  }
  in.topk_logits = {};  // the loss's input: its own rule below, once the sizes are known
  detail::check_options_and_backend(options);
  const detail::ProblemGeometry g =
      detail::validate_problem(in, IndexerBackwardOutputs{}, options,
                               options.backend == Backend::cuda ? &detail::cuda_copy_to_host : nullptr,
                               /*check_outputs=*/false);
  detail::check_topk_logits(inputs, options, g);
}

}  // namespace dsaib
