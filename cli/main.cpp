// dsaib: generate DSA lightning-indexer problems, run the backward on
// a backend, verify it against the fp64 reference, report.
//
//   dsaib generate --out p.safetensors [--preset small | --batch .. --s-q .. ...]
//   dsaib backward [--in p.safetensors | generation flags] [--out grads.safetensors]
//                            [--backend auto|cpu|cuda] [--out-dtype bf16|f32] [--verify auto|none|all|sample]
//   dsaib forward [--in p.safetensors | generation flags] [--out loss.safetensors] [--verify auto|none|all]
//   dsaib step [--in p.safetensors | generation flags] [--out step.safetensors] (flags of backward)
//   dsaib bench [--seq 4096,16384,65536] [--ids causal,random] [--heads 64] [--dim 128] [--topk 2048]
//                         [--batch 1] [--iters 20] [--warmup 3] [--sustained-ms 2000] [--json FILE] [--no-floor]
//                         (cuda builds, a GPU)
//   dsaib topk [--batch 2] [--s-q 128] [--s-kv ..] [--heads 8] [--head-dim 64] [--topk 32] [--visible causal|ranges]
//                        [--causal-offset auto|N] [--layout bshd|thd] [--id-mode local|global]
//                        [--order logit_descending|id_ascending] [--seed 0] [--backend auto|cpu|cuda] [--json]
//   dsaib presets
//
// Exit status: 0 success (and PASS), 1 verification FAIL, 2 error (bad usage, bad file, bad input).
// One file per subcommand (generate_command.cpp, operation_command.cpp, bench_command.cpp,
// topk_command.cpp, presets_command.cpp); this one builds the command line, dispatches and reports errors.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "cli.hpp"
#include "commands.hpp"

namespace dsaib::cli {
namespace {

/// Set once the command line asks for a JSON report on stdout (`backward --json`,
/// `bench --json -`): errors are then also printed as a JSON object there (besides
/// the usual line on stderr), so that a caller parsing stdout gets a report on every exit.
bool g_json_errors = false;

/// The tool's one error style on stderr, and the JSON error object on stdout
/// when g_json_errors: {"error": {"code", "argument", "message"}, "result": "ERROR", "exit_code": kExitError}.
/// The stderr line shows the message through terminal_text (it may quote names read
/// from a file); the JSON keeps it as it is (the serialiser escapes it).
void report_error(const std::string& code, const std::string& argument, const std::string& message) {
  std::cerr << "dsaib: error" << (code.empty() ? "" : " (" + code + ")") << ": " << terminal_text(message)
            << std::endl;
  if (!g_json_errors) return;
  nlohmann::ordered_json j;
  j["error"] = {{"code", code.empty() ? "error" : code}, {"argument", argument}, {"message", message}};
  j["result"] = "ERROR";
  j["exit_code"] = kExitError;
  // The message may quote a flag's value or a path that is not UTF-8: replaced
  // (U+FFFD), never thrown from here.
  std::cout << report_json_text(j) << std::endl;
}

/// A command line that did not parse: one error line naming the flag when the message starts with one.
int report_parse_error(const CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& words) {
  // No subcommand matched: name the word that came and the ones expected
  // (CLI11 says only "A subcommand is required").
  std::string message = e.what();
  if (app.get_subcommands().empty()) {  // the subcommands that were parsed: none
    std::string names;
    for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
    message = !words.empty() && words[0][0] != '-' ? "unknown subcommand '" + words[0] + "': expected one of " + names
                                                   : "a subcommand is required: one of " + names;
  }
  // A flag given twice (or with two values): CLI11 says "--seed: At Most 1
  // required but received 2".
  {
    // Only right after the flag's name: a value the user typed may hold the words.
    const std::string at_most = ": At Most 1 required but received ";
    const size_t at = message.find(": ");
    if (message.rfind("-", 0) == 0 && at != std::string::npos && message.compare(at, at_most.size(), at_most) == 0) {
      message = message.substr(0, at) + ": expected once (one value), got " + message.substr(at + at_most.size()) +
                " (given more than once?)";
    }
  }
  // `backward --json` and `bench --json -` report a command-line error as JSON too
  // (the flag is known from the words even though the parse failed).
  if (!words.empty()) {
    const std::vector<std::string> rest(words.begin() + 1, words.end());
    if (words[0] == "backward" || words[0] == "forward" || words[0] == "step") {
      g_json_errors = OperationCommand::json_requested(rest);
    }
    if (words[0] == "bench") g_json_errors = BenchCommand::json_requested(rest);
    if (words[0] == "topk") g_json_errors = OperationCommand::json_requested(rest);
  }
  // The argument is the flag the message starts with ("--sm-scale: expected ..."), if any.
  const size_t colon = message.find(": ");
  const bool starts_with_flag = message.rfind("-", 0) == 0 && colon != std::string::npos && message.find(' ') > colon;
  report_error("invalid_argument", starts_with_flag ? message.substr(0, colon) : std::string(), message);
  std::cerr << "Run with --help or --help-all for more information.\n";
  return kExitError;
}

int run_main(int argc, char** argv) {
  CLI::App app{
      "dsaib: training the DeepSeek Sparse Attention lightning indexer.\n"
      "Generates problems, runs each operation (the backward, the loss forward, the loss\n"
      "and gradients in one call, the top-k forward) on the cpu or cuda backend and verifies\n"
      "it against the fp64 reference, benchmarks it against the hardware floor.\n"
      "Exit status: 0 ok/PASS, 1 FAIL, 2 error."};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help of every subcommand");
  GenerateCommand generate(app);
  OperationCommand backward(app);
  OperationCommand forward(app, LossOp::forward);
  OperationCommand step(app, LossOp::step);
  BenchCommand bench(app);
  TopkCommand topk(app);
  PresetsCommand presets(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help and friends
    return report_parse_error(app, e, std::vector<std::string>(argv + 1, argv + argc));
  }
  if (presets.selected()) return presets.run();
  if (generate.selected()) return generate.run();
  if (bench.selected()) {
    g_json_errors = bench.json_to_stdout();
    std::string command_line;
    for (int i = 0; i < argc; ++i) command_line += (i ? " " : "") + std::string(argv[i]);
    return bench.run(command_line);
  }
  if (topk.selected()) {
    g_json_errors = topk.json();
    return topk.run();
  }
  for (OperationCommand* c : {&forward, &step}) {
    if (c->selected()) {
      g_json_errors = c->json();
      return c->run();
    }
  }
  g_json_errors = backward.json();
  return backward.run();
}

}  // namespace
}  // namespace dsaib::cli

int main(int argc, char** argv) {
  using dsaib::cli::report_error;
  try {
    return dsaib::cli::with_written_report(dsaib::cli::run_main(argc, argv), dsaib::cli::kExitError);
  } catch (const dsaib::Error& e) {
    report_error(dsaib::error_code_name(e.code()), e.argument(), e.what());
  } catch (const std::bad_alloc&) {
    report_error(dsaib::error_code_name(dsaib::ErrorCode::out_of_memory), "",
                 "out of host memory (the problem's tensors, e.g. B*S_q*topk ids and scores, do not fit: reduce "
                 "--batch/--s-q/--s-kv/--topk; the cpu backend's own working set reports itself as out_of_memory "
                 "with what it needed)");
  } catch (const std::exception& e) {
    report_error("", "", e.what());
  } catch (...) {
    report_error("", "", "unknown exception");
  }
  return dsaib::cli::kExitError;
}
