// `dsaib generate`: writes a realistic problem (inputs and metadata) to a safetensors file.
#include <chrono>
#include <filesystem>
#include <iostream>
#include <system_error>

#include "commands.hpp"

namespace dsaib::cli {

GenerateCommand::GenerateCommand(CLI::App& app) {
  cmd_ = app.add_subcommand("generate", "write a realistic problem (inputs) to a safetensors file");
  cmd_->add_option("--out,-o", out_, "output .safetensors file")->required()->check(nonempty_path());
  gen_.add(cmd_);
  scalars_.add(cmd_, false);
  cmd_->add_option("--threads", threads_, "worker threads (0: all cores)")->check(int_range(0, 1 << 20));
}

int GenerateCommand::run() {
  gen_.finish();
  check_out_path(out_, "");
  scalars_.apply_to_flags(gen_.f);
  const auto t0 = std::chrono::steady_clock::now();
  Problem p = generate(gen_.f, threads_);
  const Geometry g = analyze_problem(p);
  save_problem(out_, p);
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(out_, ec);
  std::cout << "wrote " << terminal_text(out_) << " (" << human_bytes(ec ? 0.0 : double(bytes)) << ") in "
            << human_seconds(seconds_since(t0)) << "\n"
            << "  problem     " << g.summary() << "\n"
            << "  ids         " << p.info["ids"] << ", valid slots " << g.valid_slots << " of "
            << g.num_q_rows * g.topk << "\n"
            << "  dtypes      " << tensor_dtypes(p) << "\n"
            << "  scalars     sm_scale=" << format_float(p.options.sm_scale)
            << " loss_coeff=" << format_float(p.options.loss_coeff)
            << " grad_loss=" << format_float(p.options.grad_loss) << "\n";
  return 0;
}

}  // namespace dsaib::cli
