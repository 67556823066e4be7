// dsaib-bench: the bench of every op against its floor, measured in the same run (the
// cuda backend; an sm_90 GPU). Its flags, its run and its report are those of
// `dsaib bench` (cli/bench_command.cpp, cli/bench.cpp): one parser, one JSON
// writer. What scripts/ab_compare.py pairs (two builds' dsaib-bench, --no-floor
// --sustained-ms 0) and scripts/gpu_check.sh runs.
//   dsaib-bench [--op backward,forward,step,one-call,target] [--seq 4096,16384,65536]
//               [--ids causal,random] [--heads 64] [--dim 128] [--topk 2048] [--shapes 128x576,64x192]
//               [--iters 20] [--warmup 3] [--sustained-ms 2000] [--no-floor] [--json FILE|-] ...
// `dsaib-bench --help` lists every flag and states each floor's formula.
// Exit: 0 ok, 1 a floor's correctness check failed or a CUDA error, 2 bad arguments (or an
// unwritable --json file), 77 no sm_90 GPU.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iostream>
#include <new>
#include <string>

#include "cli.hpp"
#include "commands.hpp"

namespace {

constexpr int kExitCheckFailed = 1, kExitUsage = 2, kExitNoGpu = 77;

/// One line on stderr, and (with --json -) the JSON error object on stdout, as the CLI writes it.
int report_error(bool json, const std::string& code, const std::string& argument, const std::string& message,
                 int exit_code) {
  std::cerr << "dsaib-bench: error" << (code.empty() ? "" : " (" + code + ")") << ": "
            << dsaib::cli::terminal_text(message) << std::endl;
  if (json) {
    nlohmann::ordered_json j;
    j["error"] = {{"code", code.empty() ? "error" : code}, {"argument", argument}, {"message", message}};
    j["result"] = "ERROR";
    j["exit_code"] = exit_code;
    std::cout << dsaib::cli::report_json_text(j) << std::endl;
  }
  return exit_code;
}

}  // namespace

namespace {

int run(int argc, char** argv) {
  using namespace dsaib::cli;
  CLI::App app{
      "dsaib-bench: every op of dsaib on the cuda backend (the backward, the loss forward, the loss and gradients\n"
      "in two calls or one, the attention target) against its hardware floor, measured in the same run."};
  app.set_help_flag("--help,-h", "this text");
  BenchFlags flags;
  add_bench_flags(&app, flags);
  const std::vector<std::string> words(argv + 1, argv + argc);
  const bool json = bench_json_requested(words);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    const std::string message = e.what();
    const size_t colon = message.find(": ");
    const bool names_flag = message.rfind("-", 0) == 0 && colon != std::string::npos && message.find(' ') > colon;
    report_error(json, "invalid_argument", names_flag ? message.substr(0, colon) : std::string(), message, kExitUsage);
    std::cerr << "Run with --help for more information.\n";
    return kExitUsage;
  }
  std::string command_line;
  for (int i = 0; i < argc; ++i) command_line += (i ? " " : "") + std::string(argv[i]);
  flags.args.tool = "dsaib-bench";
  try {
    return run_bench_flags(flags, command_line);
  } catch (const dsaib::Error& e) {
    const std::string code = dsaib::error_code_name(e.code());
    const int rc = e.code() == dsaib::ErrorCode::backend_unavailable ? kExitNoGpu
                   : e.code() == dsaib::ErrorCode::invalid_argument || e.code() == dsaib::ErrorCode::io_error
                       ? kExitUsage
                       : kExitCheckFailed;
    return report_error(json, code, e.argument(), e.what(), rc);
  } catch (const std::bad_alloc&) {
    return report_error(json, "out_of_memory", "", "out of host memory", kExitCheckFailed);
  } catch (const std::exception& e) {
    return report_error(json, "", "", e.what(), kExitCheckFailed);
  }
}

}  // namespace

int main(int argc, char** argv) { return dsaib::cli::with_written_report(run(argc, argv), kExitUsage); }
