// End-to-end tests of `dsaib topk` (cpu backend): it generates a problem, runs
// indexer_topk, checks it with check_indexer_topk and reports PASS (exit 0),
// as text or JSON; errors exit 2 with the flag named.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "dsaib/indexer_backward.hpp"
#include "support/test_support.hpp"

#ifndef DSAIB_CLI_PATH
#error "DSAIB_CLI_PATH (the dsaib binary) must be defined by the build"
#endif

namespace {

using Result = dsaib::test::CommandResult;

Result run(const std::string& args, bool with_stderr = true) {
  return dsaib::test::run_command(dsaib::test::shell_quote(DSAIB_CLI_PATH) + " topk " + args +
                                  (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

bool contains(const std::string& s, const std::string& frag) { return s.find(frag) != std::string::npos; }

TEST(CliTopk, TextReportPasses) {
  const Result r = run("--backend cpu --batch 2 --s-q 40 --s-kv 70 --topk 8 --threads 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "bshd B=2 S_q=40 S_kv=70 H=8 D=64 topk=8")) << r.output;
  EXPECT_TRUE(contains(r.output, "80 rows against the fp64 reference")) << r.output;
  EXPECT_TRUE(contains(r.output, "result      PASS")) << r.output;
}

TEST(CliTopk, E4m3InputsWithTheirScalesPass) {
  for (const char* layout : {"bshd", "thd"}) {
    const std::string args = std::string("--backend cpu --json --dtype e4m3 --batch 3 --s-q 33 --s-kv 90 --heads 8 ") +
                             "--head-dim 32 --topk 12 --seed 5 --threads 2 --visible ranges --layout " + layout;
    const Result r = run(args, false);
    ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["result"], "PASS") << args;
    EXPECT_EQ(j["problem"]["dtype"], "e4m3");
    EXPECT_EQ(j["check"]["exchanged_ids"], 0);
  }
  // --backend auto picks the cpu backend for e4m3 inputs of D other than 128, a CUDA device or not
  const Result automatic = run("--json --dtype e4m3 --batch 1 --s-q 9 --heads 8 --head-dim 64 --topk 4", false);
  ASSERT_EQ(automatic.exit_code, 0) << automatic.output;
  const auto j = nlohmann::json::parse(automatic.output);
  EXPECT_EQ(j["backend"]["name"], "cpu");
  EXPECT_EQ(j["backend"]["why"], "auto: e4m3 inputs of D other than 128 (the cpu backend takes them)");
  const Result bad = run("--backend cpu --dtype e5m2");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "--dtype")) << bad.output;
}

TEST(CliTopk, JsonReportsPassOverLayoutsRangesIdsAndOrders) {
  for (const char* layout : {"bshd", "thd"}) {
    for (const char* visible : {"causal", "ranges"}) {
      for (const char* rest : {"--id-mode local --order logit_descending", "--id-mode global --order id_ascending"}) {
        const std::string args = std::string("--backend cpu --json --batch 3 --s-q 33 --s-kv 90 --heads 3 --head-dim 16 ") +
                                 "--topk 12 --seed 7 --threads 2 --layout " + layout + " --visible " + visible + " " + rest;
        const Result r = run(args, false);
        ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.output;
        const auto j = nlohmann::json::parse(r.output);
        EXPECT_EQ(j["result"], "PASS") << args;
        EXPECT_EQ(j["pass"], true);
        EXPECT_EQ(j["exit_code"], 0);
        EXPECT_EQ(j["check"]["exchanged_ids"], 0);
        EXPECT_EQ(j["check"]["first_failure"], "");
        EXPECT_LE(j["check"]["max_logit_error"].get<double>(), 1.0);
        EXPECT_EQ(j["problem"]["layout"], layout);
        if (std::string(layout) == "bshd") EXPECT_EQ(j["check"]["rows"], 99);
      }
    }
  }
}

TEST(CliTopk, CausalOffsetsStrictRangesAndF32Weights) {
  for (const char* extra : {"--causal-offset -5", "--causal-offset 9223372036854775807",
                            "--causal-offset=-9223372036854775807", "--causal-offset 0 --topk 200",
                            "--visible ranges --strict-ranges --weights-f32"}) {
    const Result r = run(std::string("--backend cpu --json --s-q 20 --s-kv 50 --threads 2 ") + extra, false);
    ASSERT_EQ(r.exit_code, 0) << extra << "\n" << r.output;
    EXPECT_EQ(nlohmann::json::parse(r.output)["result"], "PASS") << extra;
  }
}

TEST(CliTopk, SameSeedSameCheck) {
  const std::string args = "--backend cpu --json --layout thd --visible ranges --seed 3";
  auto a = nlohmann::json::parse(run(args + " --threads 1", false).output);
  auto b = nlohmann::json::parse(run(args + " --threads 3", false).output);
  EXPECT_EQ(a["result"], "PASS");
  EXPECT_EQ(a["check"]["rows"], b["check"]["rows"]);
  EXPECT_EQ(a["check"]["max_logit_error"], b["check"]["max_logit_error"]);
}

// BSHD without query rows: nothing is built per batch entry, whatever --batch is.
TEST(CliTopk, EmptyProblemOfHugeBatchRunsInLittleMemory) {
  if (dsaib::test::kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  for (const char* visible : {"causal", "ranges"}) {
    const Result r = dsaib::test::run_command("ulimit -v 1000000 && " + dsaib::test::shell_quote(DSAIB_CLI_PATH) +
                                              " topk --backend cpu --json --batch 2147483647 --s-q 0 --s-kv 0 --visible " +
                                              visible + " 2>/dev/null");
    EXPECT_EQ(r.exit_code, 0) << visible << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "\"PASS\"")) << visible << ": " << r.output;
  }
}

TEST(CliTopk, ErrorsExitTwoNamingTheFlag) {
  struct Bad {
    const char* args;
    const char* argument;
    const char* message;
  };
  for (const Bad& bad : {Bad{"--topk 0", "--topk", "--topk: expected an integer in [1, 2147483647], got 0"},
                         Bad{"--causal-offset x", "--causal-offset",
                             "--causal-offset: expected auto or a decimal integer in [-2^63+1, 2^63-1], got \"x\""},
                         // the least int64 is the library's auto sentinel: refused, not run as auto
                         Bad{"--causal-offset=-9223372036854775808", "--causal-offset",
                             "--causal-offset: expected auto or a decimal integer in [-2^63+1, 2^63-1], got "
                             "\"-9223372036854775808\""},
                         Bad{"--order random", "--order", "--order"},
                         Bad{"--visible all", "--visible", "--visible"}}) {
    const Result r = run(std::string("--json ") + bad.args, false);
    EXPECT_EQ(r.exit_code, 2) << bad.args << "\n" << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["result"], "ERROR");
    EXPECT_EQ(j["error"]["argument"], bad.argument) << r.output;
    EXPECT_TRUE(contains(j["error"]["message"].get<std::string>(), bad.message)) << r.output;
  }
  if (!dsaib::cuda_backend_available()) {
    const Result r = run("--backend cuda --json", false);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["error"]["code"], "backend_unavailable") << r.output;
    EXPECT_EQ(j["error"]["argument"], "backend");
  }
  // The library's own rules: H on the cuda backend is checked there; on cpu any H.
  const Result r = run("--backend cpu --heads 3 --head-dim 5 --s-q 10 --json", false);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace

TEST(CliTopk, HelpSaysWhatTheThdKeyLengthsAre) {
  // THD draws each sequence's key count between its query count and S_kv: above S_kv when S_q is larger.
  const Result r = run("--help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "each sequence's key count is drawn between its query count and S_kv, so it can "
                                 "exceed S_kv when --s-q > --s-kv"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "THD: the longest, at least its S_q")) << r.output;
}
