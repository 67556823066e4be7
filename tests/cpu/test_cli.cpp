// End-to-end tests of the dsaib command line tool (small problems, cpu backend).
#include <gtest/gtest.h>

#include <limits>
#include <sys/stat.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "dsaib/indexer_backward.hpp"
#include "dsaib/reference.hpp"
#include "dsaib/safetensors.hpp"
#include "support/test_support.hpp"

#ifndef DSAIB_CLI_PATH
#error "DSAIB_CLI_PATH (the dsaib binary) must be defined by the build"
#endif

namespace {

using Result = dsaib::test::CommandResult;  // stdout (and stderr unless with_stderr is false)
using dsaib::test::shell_quote;
std::string quote(const std::string& s) { return shell_quote(s); }

Result run(const std::string& args, bool with_stderr = true) {
  return dsaib::test::run_command(quote(DSAIB_CLI_PATH) + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

bool contains(const std::string& s, const std::string& frag) { return s.find(frag) != std::string::npos; }

/// Writes a safetensors file of this header text and data buffer, as they are.
void write_raw_safetensors(const std::string& path, const std::string& header, const std::string& data) {
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << length << header << data;
}

class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("dsaib_cli_test." + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  static std::string path(const std::string& name) { return (dir_ / name).string(); }
  /// A tiny problem file (B2 S64 H8 D64 topk16), generated once per test suite.
  static std::string tiny_problem() {
    const std::string p = path("tiny.safetensors");
    if (!std::filesystem::exists(p)) {
      const Result r = run("generate --preset tiny --seed 3 --out " + quote(p));
      EXPECT_EQ(r.exit_code, 0) << r.output;
    }
    return p;
  }
  static std::filesystem::path dir_;
};
std::filesystem::path Cli::dir_;

TEST_F(Cli, GenerateWritesAProblemFile) {
  const std::string p = tiny_problem();
  std::map<std::string, std::string> meta;
  const auto t = dsaib::read_safetensors(p, &meta);
  ASSERT_EQ(t.size(), 6u);
  EXPECT_EQ(t.at("index_q").shape, (std::vector<int64_t>{2, 64, 8, 64}));
  EXPECT_EQ(t.at("index_q").dtype, dsaib::DType::bf16);
  EXPECT_EQ(t.at("weights").shape, (std::vector<int64_t>{2, 64, 8}));
  EXPECT_EQ(t.at("index_k").shape, (std::vector<int64_t>{2, 64, 64}));
  EXPECT_EQ(t.at("topk_indices").dtype, dsaib::DType::i32);
  EXPECT_EQ(t.at("topk_indices").shape, (std::vector<int64_t>{2, 64, 16}));
  EXPECT_EQ(t.at("attn_score").dtype, dsaib::DType::f32);
  EXPECT_EQ(t.at("index_score").shape, (std::vector<int64_t>{2, 64, 16}));
  EXPECT_EQ(meta.at("layout"), "bshd");
  EXPECT_EQ(meta.at("id_mode"), "local");
  EXPECT_EQ(meta.at("sm_scale"), "0.125");  // 1/sqrt(64)
  EXPECT_EQ(meta.at("loss_coeff"), "1");
  EXPECT_EQ(meta.at("grad_loss"), "1");
}

// Gradients far below the output dtype's range (grad_loss 1e-45: ~1e-48) round to 0;
// that is the correct rounding, not a failure (docs/math.md §6). For fp32 outputs too.
TEST_F(Cli, VerifierAcceptsGradientsBelowTheDtypeRange) {
  for (const char* dtype : {"bf16", "f32"}) {
    const Result r = run(std::string("backward --preset tiny --grad-loss 1e-45 --verify all --out-dtype ") + dtype);
    EXPECT_EQ(r.exit_code, 0) << dtype << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "result      PASS")) << r.output;
  }
}

TEST_F(Cli, BackwardOnFileVerifiesAllAndWritesGradients) {
  const std::string in = tiny_problem();
  const std::string out = path("grads.safetensors");
  const Result r = run("backward --in " + quote(in) + " --out " + quote(out) + " --verify all --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* frag : {"bshd B=2 S_q=64 S_kv=64 H=8 D=64 topk=16", "backend     cpu", "backward    ",
                           "per query row", "all rows vs the fp64 reference", "d_index_q", "d_weights", "d_index_k",
                           "result      PASS"}) {
    EXPECT_TRUE(contains(r.output, frag)) << "'" << frag << "' not in:\n" << r.output;
  }
  EXPECT_FALSE(contains(r.output, "FAIL")) << r.output;
  if (!dsaib::cuda_backend_available()) {
    EXPECT_TRUE(contains(r.output, "backend: cpu (auto: ")) << r.output;
  }
  std::map<std::string, std::string> meta;
  const auto g = dsaib::read_safetensors(out, &meta);
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g.at("d_index_q").shape, (std::vector<int64_t>{2, 64, 8, 64}));
  EXPECT_EQ(g.at("d_weights").shape, (std::vector<int64_t>{2, 64, 8}));
  EXPECT_EQ(g.at("d_index_k").shape, (std::vector<int64_t>{2, 64, 64}));
  for (const auto& [name, t] : g) EXPECT_EQ(t.dtype, dsaib::DType::bf16) << name;
  EXPECT_EQ(meta.at("out_dtype"), "bf16");
  EXPECT_EQ(meta.at("normalization_count"), "128");
}

TEST_F(Cli, ThdPresetAsBshdNeedsLengths) {
  // The thd preset has per-sequence lengths only: as bshd it needs --s-q, not a 0-length problem.
  Result r = run("generate --preset thd --layout bshd --out " + quote(path("thd_as_bshd.safetensors")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--s-q: expected a query length for --layout bshd with preset thd")) << r.output;
  EXPECT_FALSE(std::filesystem::exists(path("thd_as_bshd.safetensors")));
  r = run("generate --preset thd --layout bshd --s-q 32 --out " + quote(path("thd_as_bshd.safetensors")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST_F(Cli, NoQueryRowsPassSaysWhatWasCompared) {
  // S_q 0: nothing to compare but an all-zero d_index_k; the verdict says so, the exit status is 0.
  const Result r = run("backward --preset tiny --s-q 0 --s-kv 50 --verify all");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "result      PASS (no query rows: empty d_index_q / d_weights, d_index_k all zero)"))
      << r.output;
  const Result q = run("backward --preset tiny --verify all");
  EXPECT_EQ(q.exit_code, 0) << q.output;
  EXPECT_TRUE(contains(q.output, "result      PASS\n")) << q.output;
}

// A file of no bytes of data whose tensors are (2^31 - 1, 0, ...): the run
// needs no host memory that grows with B (before, 64 GiB of per-sequence tables,
// and the process was killed).
TEST_F(Cli, EmptyProblemOfHugeBatchFromAFileRunsInLittleMemory) {
  if (dsaib::test::kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  const std::string b = "2147483647";
  const auto tensor = [&](const char* name, const char* dtype, const std::string& rest) {
    return std::string("\"") + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[" + b + ",0" + rest +
           "],\"data_offsets\":[0,0]}";
  };
  const std::string header = "{" + tensor("index_q", "BF16", ",8,64") + "," + tensor("weights", "BF16", ",8") + "," +
                             tensor("index_k", "BF16", ",64") + "," + tensor("topk_indices", "I32", ",16") + "," +
                             tensor("attn_score", "F32", ",16") + "," + tensor("index_score", "F32", ",16") + "}";
  const std::string file = path("huge_empty_batch.safetensors");
  write_raw_safetensors(file, header, "");
  for (const char* op : {"backward", "forward", "step"}) {
    const Result r = dsaib::test::run_command("ulimit -v 1000000 && " + quote(DSAIB_CLI_PATH) + " " + op +
                                              " --json --verify all --in " + quote(file) + " 2>/dev/null");
    EXPECT_EQ(r.exit_code, 0) << op << ": " << r.output;
    ASSERT_FALSE(r.output.empty()) << op;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["result"].get<std::string>().rfind("PASS", 0), 0u) << op << ": " << r.output;
    EXPECT_EQ(j["problem"]["batch"], 2147483647) << op;
    EXPECT_EQ(j["problem"]["num_q_rows"], 0) << op;
    EXPECT_FALSE(j["problem"].contains("q_lengths")) << op << ": BSHD's lengths are batch, s_q and s_kv";
  }
  std::filesystem::remove(file);
}

TEST_F(Cli, JsonReportOnErrorsAndUnverifiedRuns) {
  // With --json, an error is also a JSON object on stdout (stderr keeps the line).
  Result r = run("backward --json --in " + quote(path("does_not_exist.safetensors")), /*with_stderr=*/false);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ASSERT_FALSE(r.output.empty());
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["result"], "ERROR");
  EXPECT_EQ(j["exit_code"], 2);
  EXPECT_EQ(j["error"]["code"], "io_error");
  EXPECT_TRUE(contains(j["error"]["message"].get<std::string>(), "does_not_exist.safetensors")) << r.output;
  // A command-line error too.
  r = run("backward --json --layout x", /*with_stderr=*/false);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ASSERT_FALSE(r.output.empty());
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["result"], "ERROR");
  EXPECT_EQ(j["error"]["code"], "invalid_argument");
  EXPECT_EQ(j["error"]["message"], "--layout: expected one of bshd, thd, got \"x\"");
  EXPECT_EQ(j["error"]["argument"], "--layout");  // the flag, as for errors after the parse
  // A flag given twice: said in the tool's words, naming the flag.
  r = run("backward --json --preset tiny --seed 1 --seed 2", /*with_stderr=*/false);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["error"]["message"], "--seed: expected once (one value), got 2 (given more than once?)") << r.output;
  EXPECT_EQ(j["error"]["argument"], "--seed");
  // A value that holds CLI11's words is quoted as it came.
  r = run("backward --json --layout " + quote("x: At Most 1 required but received 9"), /*with_stderr=*/false);
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["error"]["message"], "--layout: expected one of bshd, thd, got \"x: At Most 1 required but received 9\"")
      << r.output;
  // Bytes that are not UTF-8 in a flag's value or a path: still one JSON object
  // (replaced by U+FFFD), never an abort.
  for (const std::string& args : {std::string("backward --json --in ") + quote(path("bad\xff.safetensors")),
                                  std::string("backward --json --preset x\xff"), std::string("bench --json - --ids \xff")}) {
    r = run(args, /*with_stderr=*/false);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["result"], "ERROR") << args;
    EXPECT_TRUE(contains(j["error"]["message"].get<std::string>(), "\xef\xbf\xbd")) << args << "\n" << r.output;
  }
  // ...and a run from such a path writes its gradients (the header's "input" replaced).
  {
    const std::string in = path("in\xff.safetensors"), out = path("grads_of_bad_name.safetensors");
    std::filesystem::copy_file(tiny_problem(), in, std::filesystem::copy_options::overwrite_existing);
    r = run("backward --verify none --json --in " + quote(in) + " --out " + quote(out), /*with_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(nlohmann::json::parse(r.output)["result"], "OK (not verified)");
    std::map<std::string, std::string> meta;
    (void)dsaib::read_safetensors(out, &meta);
    EXPECT_TRUE(contains(meta.at("input"), "in\xef\xbf\xbd.safetensors")) << meta.at("input");
  }
  // Without --json, stdout stays empty on an error.
  r = run("backward --in " + quote(path("does_not_exist.safetensors")), /*with_stderr=*/false);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(r.output.empty()) << r.output;
  // Nothing checked: "pass" (no check failed) but "result" says it was not verified.
  r = run("backward --preset tiny --verify none --json", /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["result"], "OK (not verified)");
}

TEST_F(Cli, GeneratedThdGlobalIdsF32OutputsJsonReport) {
  const std::string out = path("thd_grads.safetensors");
  const Result r = run("backward --layout thd --seqlens-q 1,37,50 --heads 16 --head-dim 64 --topk 24 --id-mode global"
                       " --out-dtype f32 --verify sample --sample-rows 8 --json --out " +
                           quote(out),
                       /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["problem"]["layout"], "thd");
  EXPECT_EQ(j["problem"]["id_mode"], "global");
  EXPECT_EQ(j["problem"]["num_q_rows"], 88);
  EXPECT_EQ(j["verify"]["mode"], "sample");
  EXPECT_EQ(j["verify"]["sampled_q_rows"], 8);
  ASSERT_EQ(j["verify"]["outputs"].size(), 3u);
  for (const auto& o : j["verify"]["outputs"]) {
    EXPECT_TRUE(o["pass"].get<bool>()) << o.dump();
    EXPECT_LE(o["rel_rms"].get<double>(), 1e-3);
    EXPECT_EQ(o["dtype"], "f32");
  }
  EXPECT_TRUE(j["pass"].get<bool>());
  EXPECT_EQ(j["result"], "PASS");
  EXPECT_GT(j["timing"]["mean_seconds"].get<double>(), 0.0);
  const auto g = dsaib::read_safetensors(out);
  EXPECT_EQ(g.at("d_index_q").shape, (std::vector<int64_t>{88, 16, 64}));
  EXPECT_EQ(g.at("d_weights").shape, (std::vector<int64_t>{88, 16}));
  EXPECT_EQ(g.at("d_index_k").shape, (std::vector<int64_t>{88, 64}));
  EXPECT_EQ(g.at("d_index_k").dtype, dsaib::DType::f32);
}

// --verify sample with 1 or 2 rows still compares a selected key row (comparing only
// never-selected rows, whose reference is 0, would let no dK value fail).
TEST_F(Cli, SampleVerifyComparesASelectedKeyRowAtAnySampleSize) {
  for (const char* rows : {"1", "2", "3"}) {
    const Result r = run(std::string("backward --preset tiny --verify sample --json --sample-rows ") + rows,
                         /*with_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output);
    const auto& dk = j["verify"]["outputs"][2];
    ASSERT_EQ(dk["name"], "d_index_k");
    EXPECT_GT(dk["ref_rms"].get<double>(), 0.0) << "--sample-rows " << rows << ": " << dk.dump();
    EXPECT_TRUE(dk["pass"].get<bool>()) << dk.dump();
  }
}

// With fewer selected key rows than --sample-rows asks for, never-selected rows fill the
// sample, so that it has the size asked for.
TEST_F(Cli, SampleVerifyFillsWithUnselectedKeyRows) {
  const Result r = run("backward --s-q 2 --s-kv 2048 --topk 4 --heads 8 --head-dim 64 --verify sample "
                       "--sample-rows 40 --json",
                       /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["verify"]["sampled_k_rows"], 40) << j["verify"].dump();
  EXPECT_GT(j["verify"]["outputs"][2]["ref_rms"].get<double>(), 0.0);
}

TEST_F(Cli, ScalarOverridesReachTheReport) {
  const Result r = run("backward --in " + quote(tiny_problem()) +
                       " --sm-scale 0.5 --loss-coeff 2 --grad-loss 0.25 --normalization-count 7 --verify all");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "sm_scale=0.5 loss_coeff=2 grad_loss=0.25 N=7")) << r.output;
}

TEST_F(Cli, ComparesWithGradientsStoredInTheFileAndFailsWhenTheyDiffer) {
  // What scripts/dump_torch_step.py --with-grads stores (torch autograd), here the fp64 reference in f32.
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  dsaib::IndexerInputs in;
  in.index_q = t.at("index_q").view();
  in.weights = t.at("weights").view();
  in.index_k = t.at("index_k").view();
  in.topk_indices = t.at("topk_indices").view();
  in.attn_score = t.at("attn_score").view();
  in.index_score = t.at("index_score").view();
  dsaib::IndexerOptions opt;
  opt.sm_scale = std::stof(meta.at("sm_scale"));
  const auto ref = dsaib::reference_backward(in, opt);
  auto store = [&](const char* name, const std::vector<double>& v, double scale) {
    dsaib::HostTensor h(dsaib::DType::f32, t.at(std::string(name).substr(8)).shape);  // name minus "torch_d_"
    for (size_t i = 0; i < v.size(); ++i) h.data<float>()[i] = static_cast<float>(v[i] * scale);
    t[name] = std::move(h);
  };
  store("torch_d_index_q", ref.d_index_q, 1.0);
  store("torch_d_weights", ref.d_weights, 1.0);
  store("torch_d_index_k", ref.d_index_k, 1.0);
  dsaib::write_safetensors(path("with_grads.safetensors"), t, meta);
  Result r = run("backward --in " + quote(path("with_grads.safetensors")) + " --verify none");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "gradients stored in the input file")) << r.output;
  EXPECT_TRUE(contains(r.output, "torch_d_index_k")) << r.output;

  // Scalar flags change the problem: the stored gradients are not compared, and the report says so.
  r = run("backward --in " + quote(path("with_grads.safetensors")) + " --verify none --sm-scale 0.5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "stored      not compared: the scalar flags changed the problem")) << r.output;

  // A NaN in a stored gradient never passes, however the rest compares (the sums
  // turned NaN and the relative error read as 0 before).
  {
    auto nan_t = t;
    nan_t.at("torch_d_index_k").data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
    dsaib::write_safetensors(path("with_nan_grads.safetensors"), nan_t, meta);
    r = run("backward --in " + quote(path("with_nan_grads.safetensors")) + " --verify none");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(contains(r.output, "result      FAIL")) << r.output;
    EXPECT_TRUE(contains(r.output, "(1 non-finite reference elements)")) << r.output;
  }

  store("torch_d_weights", ref.d_weights, 1.01);  // 1% off: fails the 3e-3 bf16 threshold
  dsaib::write_safetensors(path("with_bad_grads.safetensors"), t, meta);
  r = run("backward --in " + quote(path("with_bad_grads.safetensors")) + " --verify all");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "result      FAIL")) << r.output;

  // A stored gradient that cannot be compared is an error before the run, not skipped.
  auto wrong = t;
  wrong["torch_d_index_q"] = dsaib::HostTensor(dsaib::DType::f32, {1, 2, 3});
  dsaib::write_safetensors(path("wrong_shape_grads.safetensors"), wrong, meta);
  r = run("backward --in " + quote(path("wrong_shape_grads.safetensors")) + " --verify none");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "torch_d_index_q: expected shape")) << r.output;
  EXPECT_TRUE(contains(r.output, "like index_q (a stored gradient), got shape (1, 2, 3)")) << r.output;
  wrong = t;
  wrong["torch_d_index_k"] = dsaib::HostTensor(dsaib::DType::i32, t.at("index_k").shape);
  dsaib::write_safetensors(path("wrong_dtype_grads.safetensors"), wrong, meta);
  r = run("backward --in " + quote(path("wrong_dtype_grads.safetensors")) + " --verify none");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "torch_d_index_k: expected dtype f32 or bf16 (a stored gradient), got dtype i32")) << r.output;
}

TEST_F(Cli, MalformedFileIsAnErrorNotACrash) {
  // Truncated copy of a valid file.
  const std::string good = tiny_problem();
  std::ifstream f(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), {});
  const std::string bad = path("truncated.safetensors");
  std::ofstream(bad, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  Result r = run("backward --in " + quote(bad));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "error (io_error)")) << r.output;
  EXPECT_TRUE(contains(r.output, bad)) << r.output;

  // Not a safetensors file at all.
  const std::string junk = path("junk.safetensors");
  std::ofstream(junk) << "this is not a safetensors file, just some text";
  r = run("backward --in " + quote(junk));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "header length")) << r.output;

  // Missing file.
  r = run("backward --in " + quote(path("nope.safetensors")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "cannot open")) << r.output;
}

TEST_F(Cli, WrongTensorIsAnErrorNamingIt) {
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  // Writes `tensors` and `m` as NAME.safetensors and runs backward on it (with `flags`).
  const auto backward_on = [&](const std::string& name, const decltype(t)& tensors,
                               const std::map<std::string, std::string>& m, const std::string& flags = "") {
    dsaib::write_safetensors(path(name + ".safetensors"), tensors, m);
    return run("backward --in " + quote(path(name + ".safetensors")) + flags);
  };

  auto wrong_dtype = t;
  wrong_dtype["index_q"] = dsaib::HostTensor(dsaib::DType::f32, t.at("index_q").shape);
  Result r = backward_on("wrong_dtype", wrong_dtype, meta);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "index_q: expected dtype bf16")) << r.output;

  auto wrong_shape = t;
  wrong_shape["weights"] = dsaib::HostTensor(dsaib::DType::bf16, {2, 64, 9});
  r = backward_on("wrong_shape", wrong_shape, meta);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "weights")) << r.output;

  auto wrong_rank = t;
  wrong_rank["index_k"] = dsaib::HostTensor(dsaib::DType::bf16, {128, 64});
  r = backward_on("wrong_rank", wrong_rank, meta);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "index_k: expected rank 3")) << r.output;

  // A bshd file whose metadata says thd: the first tensor checked is index_q
  // (docs/errors.md's order), and the message says where the layout came from.
  auto thd_meta = meta;
  thd_meta["layout"] = "thd";
  r = backward_on("layout_mismatch", t, thd_meta);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "index_q: expected rank 3 (thd layout, from the file's layout metadata")) << r.output;
  // It does not offer --layout, which --in refuses; the shape is written as the library writes it.
  EXPECT_FALSE(contains(r.output, "--layout")) << r.output;
  EXPECT_TRUE(contains(r.output, "got rank 4 with shape (2, 64, 8, 64)")) << r.output;

  // A misspelt metadata key and an extra tensor are named (not silently ignored); the run goes on.
  auto extra = t;
  extra["index_qq"] = dsaib::HostTensor(dsaib::DType::f32, {2});
  auto typo_meta = meta;
  typo_meta["sm_sclae"] = "0.5";
  r = backward_on("typo", extra, typo_meta);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "ignored metadata keys: sm_sclae")) << r.output;
  EXPECT_TRUE(contains(r.output, "ignored tensors: index_qq")) << r.output;
  r = run("backward --in " + quote(tiny_problem()));  // a file the CLI wrote: nothing to name
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "ignored metadata") || contains(r.output, "ignored tensors")) << r.output;

  auto missing = t;
  missing.erase("attn_score");
  r = backward_on("missing", missing, meta);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "missing tensor 'attn_score'")) << r.output;

  // Not a number; values the op would take as fp32 inf or 0 (the flags' rules);
  // leading blanks, refused as trailing ones are.
  const std::string count_rule = "metadata normalization_count: expected a decimal integer in [0, 9223372036854775807], got ";
  for (const auto& [key, value, message] :
       {std::tuple<std::string, std::string, std::string>{"sm_scale", "fast", "metadata sm_scale: expected a finite number"},
        {"sm_scale", "1e-50", "metadata sm_scale: expected a finite nonzero number (fp32 range), got \"1e-50\""},
        {"sm_scale", "1e39", "metadata sm_scale: expected a finite nonzero number (fp32 range), got \"1e39\""},
        {"loss_coeff", "-1e39", "metadata loss_coeff: expected a finite number (fp32 range), got \"-1e39\""},
        {"grad_loss", "3.5e38", "metadata grad_loss: expected a finite number (fp32 range), got \"3.5e38\""},
        {"loss_coeff", " 1", "metadata loss_coeff: expected a finite number, got \" 1\""},
        // normalization_count: a decimal integer, read exactly (not through a double)
        {"normalization_count", "128.0", count_rule + "\"128.0\""},
        {"normalization_count", "0x80", count_rule + "\"0x80\""},
        {"normalization_count", "-1", count_rule + "\"-1\""},
        {"normalization_count", "007", count_rule + "\"007\""},
        {"normalization_count", "-0", count_rule + "\"-0\""},
        {"normalization_count", "9223372036854775808", count_rule + "\"9223372036854775808\""}}) {
    auto m = meta;
    m[key] = value;
    r = backward_on("range_meta", t, m);
    EXPECT_EQ(r.exit_code, 2) << key << "=" << value << ": " << r.output;
    EXPECT_TRUE(contains(r.output, message)) << r.output;
  }
  // The largest counts round-trip exactly (2^53 + 1 is not a double; 2^63 - 1 is what the flag allows).
  for (const char* n : {"9007199254740993", "9223372036854775807"}) {
    auto m = meta;
    m["normalization_count"] = n;
    r = backward_on("big_n", t, m, " --verify none --json");
    EXPECT_EQ(r.exit_code, 0) << n << ": " << r.output;
    EXPECT_TRUE(contains(r.output, std::string("\"normalization_count\": ") + n)) << r.output;
  }
  // A bad value that a flag overrides is not read.
  auto zero_scale = meta;
  zero_scale["sm_scale"] = "0";
  r = backward_on("zero_scale", t, zero_scale, " --sm-scale 0.125");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // Underflow is a value (0 after rounding), as for the flags; only sm_scale must stay nonzero.
  auto tiny = meta;
  tiny["grad_loss"] = "1e-400";
  r = backward_on("tiny_meta", t, tiny);
  EXPECT_NE(r.exit_code, 2) << r.output;
}

TEST_F(Cli, FileWrittenWithTheLargestFloatLoadsBack) {
  // generate prints 3.4028234e38 as "3.40282347e+38", which rounds to the largest
  // float, not to inf: backward must read it (and the flag must take that text).
  const std::string f = path("max_float.safetensors");
  Result r = run("generate --preset tiny --loss-coeff 3.4028234e38 --out " + quote(f));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run("backward --in " + quote(f));
  EXPECT_NE(r.exit_code, 2) << r.output;
  EXPECT_FALSE(contains(r.output, "fp32 range")) << r.output;
  r = run("backward --preset tiny --loss-coeff 3.40282347e+38");
  EXPECT_NE(r.exit_code, 2) << r.output;
  EXPECT_FALSE(contains(r.output, "fp32 range")) << r.output;
}

// `bench` runs only with the cuda backend on a GPU; elsewhere it must say so and fail
// (exit 2), in a build without CUDA as in a cuda build on a machine without a GPU.
TEST_F(Cli, BenchWithoutAGpuSaysItNeedsTheCudaBackendAndAGpu) {
  if (dsaib::cuda_backend_available()) GTEST_SKIP() << "a compute-capability-9.0 GPU is present: bench would run";
  for (const std::string& args :
       {std::string("bench"), "bench --seq 256 --ids random --iters 1 --json " + quote(path("b.json")),
        std::string("bench --op forward"), std::string("bench --op step"), std::string("bench --op one-call")}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error (backend_unavailable): bench needs the CUDA backend and a GPU")) << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(path("b.json")));
  const Result bad_op = run("bench --op loss");
  EXPECT_EQ(bad_op.exit_code, 2) << bad_op.output;
  EXPECT_TRUE(contains(bad_op.output, "--op")) << bad_op.output;
  // With --json - the JSON goes to stdout, and so does the error, as a JSON object (as backward --json),
  // a command-line error included.
  for (const auto& [args, code] : {std::pair<std::string, std::string>{"bench --seq 256 --json -", "backend_unavailable"},
                                   {"bench --json - --iters x", "invalid_argument"}}) {
    const Result r = run(args, /*with_stderr=*/false);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    const nlohmann::json j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["result"], "ERROR") << args;
    EXPECT_EQ(j["error"]["code"], code) << args;
  }
}

TEST_F(Cli, BenchHelpStatesTheFloorFormulaAndBadFlagsExitWithTwo) {
  const Result help = run("bench --help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  for (const char* frag : {"--seq", "--ids", "--heads", "--dim", "--topk", "--batch", "--iters", "--warmup", "--json",
                           "--no-floor", "floor ns/row = max(topk*D*4 B / scatter rate", "6*H*D*topk FLOP / GEMM rate",
                           "x278", "--sustained-ms", "back to back"}) {
    EXPECT_TRUE(contains(help.output, frag)) << "'" << frag << "' not in:\n" << help.output;
  }
  for (const std::string args : {"bench --dim 96", "bench --ids causal,sorted", "bench --seq 0", "bench --iters 0",
                                 "bench --bogus"}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
  }
}

// Sizes beyond the 2^31 - 1 row limit (or whose sums / products overflow int64)
// are errors naming the flag, the limit and the value: no crash, no bad_alloc.
TEST_F(Cli, HugeSizesAreErrorsNamingTheFlagAndTheLimit) {
  const std::string out = path("huge.safetensors");
  const std::string h = "4611686018427387904";  // 2^62
  const struct {
    std::string args, flag, value;
  } cases[] = {
      {"generate --preset thd --seqlens-q " + h + "," + h + "," + h + "," + h, "--seqlens-q", h},
      {"backward --preset thd --seqlens-q 1,1 --seqlens-k 9223372036854775807,2", "--seqlens-k", "9223372036854775807"},
      {"generate --preset tiny --batch 4 --s-q " + h + " --s-kv 0", "--s-q", h},
      {"generate --preset tiny --batch 2 --s-q " + h, "--s-q", h},
      {"generate --preset tiny --batch 2 --s-q 2 --s-kv " + h, "--s-kv", h},
      {"generate --preset tiny --batch 4000000000 --s-q 4000000000", "--batch", "4000000000"},
      {"generate --preset tiny --layout thd --batch 3000000000 --s-q 1", "--batch", "3000000000"},
      {"generate --preset tiny --batch 2 --s-q 1073741824", "--s-q", "1073741824"},
  };
  for (const auto& c : cases) {
    const std::string args = c.args + (c.args.rfind("generate", 0) == 0 ? " --out " + quote(out) : "");
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error (invalid_argument): " + c.flag + ": expected")) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "2147483647")) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, c.value)) << args << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "out of host memory")) << args << "\n" << r.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << args;
  }
}

// Sequence lengths: empty items are errors, not zeros or dropped; the error names
// the flag holding the bad item and shows it.
TEST_F(Cli, SequenceLengthListsRejectEmptyAndNegativeItems) {
  const struct {
    std::string args, flag, frag;
  } cases[] = {
      {"--seqlens-q ''", "--seqlens-q", "without empty items, got \"\""},
      {"--seqlens-q 1,,2", "--seqlens-q", "without empty items, got \"1,,2\""},
      {"--seqlens-q 1,2,", "--seqlens-q", "\"1,2,\""},
      {"--seqlens-q 3,-5", "--seqlens-q", "got -5 in \"3,-5\""},
      {"--seqlens-q 3,5 --seqlens-k 1,-5", "--seqlens-k", "got -5 in \"1,-5\""},
      {"--seqlens-q 3,5 --seqlens-k 1,,5", "--seqlens-k", "\"1,,5\""},
      {"--seqlens-q 3,x", "--seqlens-q", "\"x\""},
      {"--seqlens-q +5,3", "--seqlens-q", "expected a decimal integer, got \"+5\" in \"+5,3\""},
      {"--seqlens-q 5,007", "--seqlens-q", "without leading zeros, got \"007\" in \"5,007\""},
      // given twice: an error, as for every other option (CLI11 appends lists)
      {"--seqlens-q 3,5 --seqlens-q 7", "--seqlens-q", "once (one comma-separated list), got 2 times"},
      {"--seqlens-q 3,5 --seqlens-k 4 6 --seqlens-k=4,6", "--seqlens-k", "got 2 times"},
  };
  for (const auto& c : cases) {
    const std::string args = "backward --preset tiny --verify none " + c.args;
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error (invalid_argument): " + c.flag + ": expected")) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, c.frag)) << args << "\n" << r.output;
  }
  // Well-formed lists still work, as one token or several.
  const Result ok = run("backward --preset tiny --verify none --seqlens-q 3,5 --seqlens-k 4 6 --json", false);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  const auto j = nlohmann::json::parse(ok.output);
  EXPECT_EQ(j["problem"]["q_lengths"], (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(j["problem"]["k_lengths"], (std::vector<int64_t>{4, 6}));
}

// --out is checked before any work: not the input file (it would be overwritten
// with the gradients), not a directory, in an existing directory.
TEST_F(Cli, OutputPathIsCheckedUpFront) {
  const std::string in = path("keep.safetensors");
  std::filesystem::copy_file(tiny_problem(), in, std::filesystem::copy_options::overwrite_existing);
  const auto size = std::filesystem::file_size(in);
  for (const std::string& out : {in, path("sub/../keep.safetensors")}) {
    std::filesystem::create_directories(path("sub"));
    const Result r = run("backward --verify none --in " + quote(in) + " --out " + quote(out));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--out: expected a file other than the input")) << r.output;
    EXPECT_FALSE(contains(r.output, "backend:")) << "not up front:\n" << r.output;
  }
  EXPECT_EQ(std::filesystem::file_size(in), size);
  EXPECT_EQ(dsaib::read_safetensors(in).count("index_q"), 1u);

  for (const std::string& args : {"backward --verify none --in " + quote(in) + " --out " + quote(path("sub")),
                                  "generate --preset tiny --out " + quote(path("sub")),
                                  "generate --preset tiny --out " + quote(path("nonexistent/x.safetensors")),
                                  "backward --preset tiny --out " + quote(path("nonexistent/x.safetensors"))}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error (io_error): --out: expected a file")) << args << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "generate: done")) << "not up front: " << args << "\n" << r.output;
  }
}

// An existing FIFO or device as --out is refused up front and left as it was
// (writing by rename would replace it); a symbolic link is written through.
TEST_F(Cli, OutputPathFifoRefusedSymlinkFollowed) {
  namespace fs = std::filesystem;
  const std::string fifo = path("out.fifo");
  std::error_code ec;
  fs::remove(fifo, ec);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& args : {"generate --preset tiny --out " + quote(fifo),
                                  "backward --preset tiny --verify none --out " + quote(fifo)}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error (io_error): --out: expected a regular file or a new path")) << r.output;
    EXPECT_TRUE(contains(r.output, "a FIFO")) << r.output;
    EXPECT_FALSE(contains(r.output, "generate: done")) << "not up front: " << args << "\n" << r.output;
  }
  EXPECT_TRUE(fs::is_fifo(fs::status(fifo)));
  const std::string target = path("target.safetensors"), link = path("link.safetensors");
  fs::remove(link, ec);
  fs::copy_file(tiny_problem(), target, fs::copy_options::overwrite_existing);
  fs::create_symlink(target, link);
  const Result r = run("generate --preset tiny --seed 9 --out " + quote(link));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link)));
  EXPECT_EQ(dsaib::read_safetensors(target).count("index_q"), 1u);
}

// The report states the a-operand precision; the cpu backend ignores it.
TEST_F(Cli, ReportStatesTheAOperandPrecision) {
  const std::string in = tiny_problem();
  Result r = run("backward --backend cpu --verify none --a-operand bf16x2 --in " + quote(in));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "  a operand   ignored (cpu backend)")) << r.output;
  r = run("backward --backend cpu --verify none --json --a-operand bf16 --in " + quote(in), false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["a_operand"]["requested"], "bf16");
  EXPECT_EQ(j["a_operand"]["used"], "ignored (cpu backend)");
  r = run("backward --backend cpu --verify none --json --in " + quote(in), false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["a_operand"]["requested"], "auto");
}

// The launch options reach the library as option fields; the cpu backend ignores them,
// and a word outside their choices is an error naming the flag.
TEST_F(Cli, LaunchOptionFlagsAreAcceptedAndCheckedOnBothSubcommands) {
  const std::string in = tiny_problem();
  Result r = run("backward --backend cpu --verify all --l2-hints on --start-stagger off --in " + quote(in));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const std::string cmd : {"backward --backend cpu --in " + quote(in), std::string("bench")}) {
    r = run(cmd + " --l2-hints maybe");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--l2-hints: expected one of auto, on, off, got \"maybe\"")) << r.output;
    r = run(cmd + " --start-stagger on");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--start-stagger: expected one of auto, off, got \"on\"")) << r.output;
  }
}

// Flag values out of range or not among the choices: "--flag: expected ..., got VALUE" (no double-formatted
// CLI11 bounds); backward --warmup is bounded like bench's.
TEST_F(Cli, FlagValueErrorsNameTheFlagAndTheValue) {
  const struct {
    std::string args, message;
  } cases[] = {
      {"backward --sample-rows 0", "--sample-rows: expected >= 1, got 0"},
      {"backward --sample-rows x", "--sample-rows: expected an integer >= 1, got \"x\""},
      {"backward --threads -1", "--threads: expected an integer in [0, 1048576], got -1"},
      {"backward --warmup -5", "--warmup: expected an integer in [0, 100000], got -5"},
      {"backward --warmup 100001", "--warmup: expected an integer in [0, 100000], got 100001"},
      {"backward --repeat 0", "--repeat: expected an integer in [1, 1000000], got 0"},
      {"backward --normalization-count -3", "--normalization-count: expected >= 0, got -3"},
      // THD lengths make --batch / --s-q / --s-kv meaningless: refused, not dropped.
      {"backward --layout thd --seqlens-q 2,3 --batch 5",
       "--batch: expected 2 (the number of sequences in 2,3) or no --batch, got 5"},
      {"backward --preset thd --batch 5", "--batch: expected 3 (the number of sequences in 1,37,300) or no --batch, got 5"},
      {"backward --seqlens-q 2,3 --s-q 9", "--s-q: expected no --s-q with the query lengths of --seqlens-q (2,3), got 9"},
      {"backward --layout thd --seqlens-q 2,3 --s-kv 4",
       "--s-kv: expected no --s-kv with the key lengths of --seqlens-q (2,3), got 4"},
      {"generate --out x.safetensors --preset thd --s-q 10",
       "--s-q: expected no --s-q with the query lengths of preset thd (1,37,300), got 10"},
      {"backward --preset thd --s-kv 20", "--s-kv: expected no --s-kv with the key lengths of preset thd (1,37,300), got 20"},
      {"backward --preset tiny --seqlens-k 4,5,6",
       "--seqlens-k: expected 2 lengths (one per query sequence, from B of preset tiny), got 3"},
      {"backward --preset tiny --layout thd --batch 0",
       "--batch: expected at least one sequence (B >= 1) for layout thd, got B = 0"},
      {"backward --normalization-count 99999999999999999999",
       "--normalization-count: expected an integer in [0, 9223372036854775807], got 99999999999999999999"},
      {"generate --threads -2 --out x.safetensors", "--threads: expected an integer in [0, 1048576], got -2"},
      {"bench --seq 0", "error (invalid_argument): --seq: expected sequence lengths >= 1, got 0 in \"0\""},
      {"bench --seq 64,-1", "--seq: expected sequence lengths >= 1, got -1"},
      {"bench --topk -1", "--topk: expected >= 1, got -1"},
      {"bench --batch 0", "--batch: expected >= 1, got 0"},
      {"bench --iters 0", "--iters: expected an integer in [1, 100000], got 0"},
      {"bench --warmup -5", "--warmup: expected an integer in [0, 100000], got -5"},
      {"bench --sustained-ms -1", "--sustained-ms: expected a number of milliseconds from 0 to 600000, got \"-1\""},
      {"bench --sustained-ms nan", "--sustained-ms: expected a number of milliseconds from 0 to 600000, got \"nan\""},
      {"bench --sustained-ms 0x10", "--sustained-ms: expected a number of milliseconds from 0 to 600000, got \"0x10\""},
      {"bench --sustained-ms 5abc", "--sustained-ms: expected a number of milliseconds from 0 to 600000, got \"5abc\""},
      {"bench --sustained-ms 600001",
       "--sustained-ms: expected a number of milliseconds from 0 to 600000, got \"600001\""},
      // Scalars and seeds are checked where they are typed, not blamed on a file or clamped.
      {"backward --preset tiny --sm-scale nan", "--sm-scale: expected a finite nonzero number (fp32 range), got nan"},
      {"backward --preset tiny --grad-loss inf", "--grad-loss: expected a finite number (fp32 range), got inf"},
      {"backward --preset tiny --sm-scale 0", "--sm-scale: expected a finite nonzero number (fp32 range), got 0"},
      {"backward --in ''", "--in: expected a file name, got \"\""},  // an unset $FILE: not a generated run
      {"bench --json ''", "--json: expected a file name, got \"\""},
      {"backward --preset tiny --sm-scale 1e-50", "--sm-scale: expected a finite nonzero number (fp32 range), got 1e-50"},
      // CLI11 reads integers in base 0: leading zeros (octal) and hex are refused, not converted.
      {"backward --preset tiny --seed 010", "--seed: expected a decimal integer without leading zeros, got \"010\""},
      {"backward --preset tiny --topk 010", "--topk: expected a decimal integer without leading zeros, got \"010\""},
      {"backward --preset tiny --heads 0x40", "--heads: expected a decimal integer, got \"0x40\""},
      {"bench --heads 064", "--heads: expected a decimal integer without leading zeros, got \"064\""},
      {"backward --preset tiny --threads 08", "--threads: expected a decimal integer without leading zeros, got \"08\""},
      {"backward --preset tiny --loss-coeff 1e39", "--loss-coeff: expected a finite number (fp32 range), got 1e39"},
      {"generate --preset tiny --seed -1 --out x.safetensors", "--seed: expected an integer in [0, 2^64 - 1], got \"-1\""},
      {"backward --preset tiny --verify none --out ''", "--out: expected a file name, got \"\""},
      {"bench --heads 12", "dsaib: error (invalid_argument): --heads: expected a multiple of 8 in [8, 128], got 12"},
      // The generator's field errors are named by the flag that set the field.
      {"backward --preset tiny --topk 0", "error (invalid_argument): --topk: expected >= 1, got 0"},
      {"backward --preset tiny --heads 12", "error (invalid_argument): --heads: expected a multiple of 8 in [8, 128], got 12"},
      {"generate --preset tiny --head-dim 32 --out x.safetensors", "error (invalid_argument): --head-dim: expected 64 or 128, got 32"},
      {"generate --preset tiny --out ''", "--out: expected a file name, got \"\""},
      // A file that cannot be read is named with the flag it came from.
      {"backward --in /nonexistent/p.safetensors",
       "error (io_error): --in: /nonexistent/p.safetensors: cannot open for reading"},
      {"backward --preset tiny --seed 18446744073709551616",
       "--seed: expected an integer in [0, 2^64 - 1], got \"18446744073709551616\""},
      // bench's lists: empty items are errors naming the flag (CLI11's delimiter alone drops
      // "4096,,16384"'s empty item), in builds with and without CUDA.
      {"bench --seq 4096,,16384",
       "error (invalid_argument): --seq: expected a comma-separated list of sequence lengths >= 1 without empty "
       "items, got \"4096,,16384\""},
      {"bench --seq 4096,", "error (invalid_argument): --seq: expected a comma-separated list"},
      {"bench --seq 4k", "error (invalid_argument): --seq: expected integer sequence lengths >= 1, got \"4k\""},
      {"bench --ids causal,,random",
       "error (invalid_argument): --ids: expected a comma-separated list of id patterns without empty items, got "
       "\"causal,,random\""},
      {"bench --ids ,random", "error (invalid_argument): --ids: expected a comma-separated list"},
      // Choices: the list and the value, in the same form.
      {"bench --ids causal,sorted",
       "error (invalid_argument): --ids: expected one of causal, random, causal-shuffled, random-shuffled, got "
       "\"sorted\""},
      {"backward --preset tiny --backend gpu", "--backend: expected one of auto, cpu, cuda, got \"gpu\""},
      {"generate --preset tiny --layout bhsd --out x.safetensors", "--layout: expected one of bshd, thd, got \"bhsd\""},
  };
  for (const auto& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, c.message)) << c.args << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "0.000000")) << c.args << "\n" << r.output;
  }
}

// Every integer flag has one parse: text at or beyond 2^63 is out of range and
// echoed as typed, never clamped to 9223372036854775807 (which then read as
// "--batch: ... got 9223372036854775807" or blamed an int64 product).
TEST_F(Cli, IntegerFlagsBeyondInt64AreEchoedAsTyped) {
  const std::string big = "99999999999999999999", two63 = "9223372036854775808";
  const struct {
    std::string args, message;
  } cases[] = {
      {"backward --preset tiny --batch " + big, "--batch: expected an integer in [0, 9223372036854775807], got " + big},
      {"backward --preset tiny --s-q " + big, "--s-q: expected an integer in [0, 9223372036854775807], got " + big},
      {"backward --preset tiny --s-kv " + big, "--s-kv: expected an integer in [0, 9223372036854775807], got " + big},
      {"backward --preset tiny --topk " + big, "--topk: expected an integer in [1, 9223372036854775807], got " + big},
      {"backward --preset tiny --heads " + big, "--heads: expected a multiple of 8 in [8, 128], got " + big},
      {"backward --preset tiny --head-dim " + big, "--head-dim: expected 64 or 128, got " + big},
      {"backward --preset tiny --batch -" + big, "--batch: expected an integer in [0, 9223372036854775807], got -" + big},
      {"backward --preset tiny --s-q " + two63, "--s-q: expected an integer in [0, 9223372036854775807], got " + two63},
      {"generate --preset tiny --out x.safetensors --topk " + two63,
       "--topk: expected an integer in [1, 9223372036854775807], got " + two63},
      {"generate --preset tiny --out x.safetensors --s-kv " + big,
       "--s-kv: expected an integer in [0, 9223372036854775807], got " + big},
      {"backward --preset tiny --sample-rows " + big,
       "--sample-rows: expected an integer in [1, 9223372036854775807], got " + big},
      {"backward --preset tiny --threads " + big, "--threads: expected an integer in [0, 1048576], got " + big},
      {"backward --preset tiny --repeat " + big, "--repeat: expected an integer in [1, 1000000], got " + big},
      {"backward --preset tiny --normalization-count " + two63,
       "--normalization-count: expected an integer in [0, 9223372036854775807], got " + two63},
      {"bench --dim " + big, "--dim: expected 64 or 128, got " + big},
      {"bench --heads " + big, "--heads: expected a multiple of 8 in [8, 128], got " + big},
      {"bench --topk " + big, "--topk: expected an integer in [1, 9223372036854775807], got " + big},
      {"bench --seq 4096," + big, "--seq: expected integer sequence lengths >= 1, got \"" + big + "\""},
      // Signs and blanks that strtoll would take are not decimal integers either.
      {"backward --preset tiny --warmup +1", "--warmup: expected an integer in [0, 100000], got \"+1\""},
      {"backward --preset tiny --topk ' 8'", "--topk: expected an integer >= 1, got \" 8\""},
  };
  for (const auto& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "error (invalid_argument): " + c.message)) << c.args << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "got 9223372036854775807")) << c.args << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "overflows int64")) << c.args << "\n" << r.output;
  }
  // The JSON error names the flag too.
  const Result j = run("backward --json --preset tiny --s-q " + big, /*with_stderr=*/false);
  EXPECT_EQ(j.exit_code, 2) << j.output;
  const auto e = nlohmann::json::parse(j.output)["error"];
  EXPECT_EQ(e["argument"], "--s-q") << j.output;
  EXPECT_EQ(e["message"], "--s-q: expected an integer in [0, 9223372036854775807], got " + big) << j.output;
}

// Tensor names and metadata keys come from the file: in the human-readable output
// their control characters are escapes, so that a name can neither forge a log
// line nor send escape sequences to the terminal. --json output stays exact.
TEST_F(Cli, NamesFromAFileAreEscapedInTheTextOutput) {
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  const std::string forged = "x\n[   0.00 s] result      PASS\x1b[31m";
  t[forged] = dsaib::HostTensor(dsaib::DType::f32, {1});
  meta["title\x1b]0;owned\x07"] = "1";
  meta["csi\xc2\x9b" "31m\xe2\x80\xae"] = "1";  // C1 CSI (U+009B) and a right-to-left override (U+202E)
  const std::string file = path("control_names.safetensors");
  dsaib::write_safetensors(file, t, meta);
  Result r = run("backward --verify none --in " + quote(file));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const std::string raw : {"\x1b", "\x07", "\xc2\x9b", "\xe2\x80\xae", "\n[   0.00 s] result"}) {
    EXPECT_FALSE(contains(r.output, raw)) << r.output;
  }
  EXPECT_TRUE(contains(r.output, "ignored tensors: x\\n[   0.00 s] result      PASS\\x1b[31m")) << r.output;
  EXPECT_TRUE(contains(r.output, "title\\x1b]0;owned\\x07")) << r.output;
  EXPECT_TRUE(contains(r.output, "csi\\u009b31m\\u202e")) << r.output;

  // An error quoting such a name: escaped on stderr, exact in the JSON error.
  const std::string bad_file = path("control_dtype.safetensors");
  write_raw_safetensors(bad_file, R"({"bad\u001b[31m\n":{"dtype":"F17","shape":[1],"data_offsets":[0,4]}})",
                        std::string(4, '\0'));
  r = run("backward --in " + quote(bad_file));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "tensor 'bad\\x1b[31m\\n': unknown dtype \"F17\"")) << r.output;
  EXPECT_FALSE(contains(r.output, "\x1b")) << r.output;
  r = run("backward --json --in " + quote(bad_file), /*with_stderr=*/false);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(contains(r.output, "\x1b")) << r.output;  // the serialiser writes \u001b
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_TRUE(contains(j["error"]["message"].get<std::string>(), "tensor 'bad\x1b[31m\n': unknown dtype")) << r.output;
  EXPECT_EQ(j["error"]["argument"], "--in");
}

// Headers made to exhaust the reader are io_errors naming --in and the file,
// found at once: 200000 empty entries (2.3 MB) took 7 minutes to refuse; a
// 100 MB header of nested arrays took 3.9 GB of memory and, under a memory
// limit, read as out_of_memory with advice about --batch and no argument in the JSON.
TEST_F(Cli, AdversarialHeadersAreIoErrorsNamingTheFile) {
  std::string entries = "{";
  for (int i = 0; i < 200000; ++i) entries += (i ? ",\"" : "\"") + std::to_string(i) + "\":{}";
  const std::string many = path("many.st");
  write_raw_safetensors(many, entries + "}", "");
  Result r = dsaib::test::run_command("timeout 20 " + quote(DSAIB_CLI_PATH) + " backward --verify none --in " +
                                      quote(many) + " 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.output;  // 124: timed out
  EXPECT_TRUE(contains(r.output, "error (io_error): --in: " + many + ": tensor '0': missing \"dtype\"")) << r.output;
  std::filesystem::remove(many);

  if (dsaib::test::kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  const size_t levels = 49999999;
  std::string deep = std::string(levels, '[') + std::string(levels, ']');
  deep.resize(100'000'000, ' ');
  const std::string deep_file = path("deep.st");
  write_raw_safetensors(deep_file, deep, "");
  deep.clear();
  deep.shrink_to_fit();
  r = dsaib::test::run_command("ulimit -v 1000000 && " + quote(DSAIB_CLI_PATH) + " backward --json --in " +
                               quote(deep_file) + " 2>/dev/null");
  std::filesystem::remove(deep_file);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["error"]["code"], "io_error") << r.output;
  EXPECT_EQ(j["error"]["argument"], "--in") << r.output;
  EXPECT_EQ(j["error"]["message"], "--in: " + deep_file + ": header: expected a JSON object, got an array") << r.output;
}

// The warning about NaN/inf inputs says what the backends do: a NaN logit q.k
// propagates as torch's relu does; weights propagate; attn_score and index_score
// at valid slots propagate. Non-finite inputs are never a PASS.
TEST_F(Cli, NonFiniteInputWarningSaysWhatHappens) {
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  t.at("index_q").data<uint16_t>()[5] = 0x7fc0;  // bf16 NaN
  dsaib::write_safetensors(path("nan_q.safetensors"), t, meta);
  Result r = run("backward --backend cpu --verify none --in " + quote(path("nan_q.safetensors")));
  EXPECT_TRUE(contains(r.output, "warning: non-finite input values (index_q: 1 (first at element 5))")) << r.output;
  EXPECT_TRUE(contains(r.output, "propagates as torch's relu does (relu(NaN) = NaN)")) << r.output;
  EXPECT_FALSE(contains(r.output, "not propagated")) << r.output;
  EXPECT_FALSE(contains(r.output, "attn_score: at a valid slot")) << r.output;  // only the affected inputs
  // The NaN reaches the outputs (the row's gradients and its keys'), and a NaN input is never a PASS.
  EXPECT_TRUE(contains(r.output, "result      FAIL (non-finite inputs: index_q: 1 (first at element 5))")) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  r = run("backward --backend cpu --verify all --json --in " + quote(path("nan_q.safetensors")), false);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["nonfinite_inputs"]["index_q"], 1) << r.output;
  EXPECT_GT(j["nonfinite_outputs"], 0) << r.output;
  EXPECT_EQ(j["pass"], false) << r.output;

  // NaN scores at an invalid slot (id -1) are never read: no warning, no FAIL.
  {
    auto u = dsaib::read_safetensors(tiny_problem(), &meta);
    const int64_t topk = u.at("topk_indices").shape.back();
    int32_t* ids = u.at("topk_indices").data<int32_t>();
    ids[topk - 1] = -1;  // row 0, last slot
    u.at("attn_score").data<float>()[topk - 1] = std::nanf("");
    u.at("index_score").data<float>()[topk - 1] = std::nanf("");
    dsaib::write_safetensors(path("nan_invalid.safetensors"), u, meta);
    const Result ri = run("backward --backend cpu --verify all --in " + quote(path("nan_invalid.safetensors")));
    EXPECT_EQ(ri.exit_code, 0) << ri.output;
    EXPECT_FALSE(contains(ri.output, "non-finite")) << ri.output;
  }
  // NaN in index_q / weights counts only in query rows with a valid slot (a row
  // with none is never read; it must not fail the verdict).
  {
    auto u = dsaib::read_safetensors(tiny_problem(), &meta);
    const dsaib::HostTensor& q = u.at("index_q");
    const int64_t topk = u.at("topk_indices").shape.back(), per_row_q = q.shape[2] * q.shape[3];
    const int64_t heads = q.shape[2], row = 3;
    int32_t* ids = u.at("topk_indices").data<int32_t>();
    for (int64_t i = 0; i < topk; ++i) ids[row * topk + i] = -1;  // row 3: no valid slot
    u.at("index_q").data<uint16_t>()[row * per_row_q + 7] = 0x7fc0;
    u.at("weights").data<uint16_t>()[row * heads + 1] = 0x7fc0;
    dsaib::write_safetensors(path("nan_q_unused.safetensors"), u, meta);
    const Result ru = run("backward --backend cpu --verify all --in " + quote(path("nan_q_unused.safetensors")));
    EXPECT_EQ(ru.exit_code, 0) << ru.output;
    EXPECT_FALSE(contains(ru.output, "non-finite")) << ru.output;
    u.at("topk_indices").data<int32_t>()[row * topk] = 0;  // key 0: row 3 now uses its index_q and weights
    dsaib::write_safetensors(path("nan_q_used.safetensors"), u, meta);
    const Result rr = run("backward --backend cpu --verify none --in " + quote(path("nan_q_used.safetensors")));
    EXPECT_EQ(rr.exit_code, 1) << rr.output;
    EXPECT_TRUE(contains(rr.output, "index_q: 1 (first at element " + std::to_string(row * per_row_q + 7) + ")")) << rr.output;
    EXPECT_TRUE(contains(rr.output, "weights: 1 (first at element " + std::to_string(row * heads + 1) + ")")) << rr.output;
  }
  // NaN in index_k counts only in key rows that a valid slot selects (an unread
  // row must not fail the verdict).
  {
    auto u = dsaib::read_safetensors(tiny_problem(), &meta);
    u.at("index_k").data<uint16_t>()[3] = 0x7fc0;  // key row 0 (selected: causal, slot 0 of row 0)
    dsaib::write_safetensors(path("nan_k_read.safetensors"), u, meta);
    const Result rr = run("backward --backend cpu --verify none --in " + quote(path("nan_k_read.safetensors")));
    EXPECT_TRUE(contains(rr.output, "index_k: 1 (first at element 3)")) << rr.output;
    EXPECT_EQ(rr.exit_code, 1) << rr.output;
    int32_t* ids = u.at("topk_indices").data<int32_t>();
    for (int64_t e = 0; e < u.at("topk_indices").numel(); ++e) {
      if (ids[e] == 0) ids[e] = -1;  // now no valid slot selects key row 0
    }
    dsaib::write_safetensors(path("nan_k_unread.safetensors"), u, meta);
    const Result ru = run("backward --backend cpu --verify all --in " + quote(path("nan_k_unread.safetensors")));
    EXPECT_EQ(ru.exit_code, 0) << ru.output;
    EXPECT_FALSE(contains(ru.output, "non-finite")) << ru.output;
  }
  t.at("attn_score").data<float>()[0] = std::nanf("");  // row 0, slot 0: valid (causal, key 0)
  dsaib::write_safetensors(path("nan_qt.safetensors"), t, meta);
  r = run("backward --backend cpu --verify none --in " + quote(path("nan_qt.safetensors")));
  EXPECT_TRUE(contains(r.output, "attn_score: 1 (first at element 0)")) << r.output;
  EXPECT_TRUE(contains(r.output, "into every gradient of that query row")) << r.output;
  EXPECT_TRUE(contains(r.output, "non-finite  ")) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
}

// Finite inputs whose gradients overflow the output dtype: the outputs are inf
// (IEEE rounding), the report says overflow and gives the reference's size.
TEST_F(Cli, OverflowingGradientsAreReportedAsOverflow) {
  const std::string scalars = " --sm-scale 3e38 --grad-loss 1e30 --loss-coeff 1e8 --in " + quote(tiny_problem());
  Result r = run("backward --verify all" + scalars);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "the fp64 reference exceeds the output dtype's range: overflow in d_index_q")) << r.output;
  EXPECT_FALSE(contains(r.output, "unwritten")) << r.output;
  r = run("backward --verify all --json" + scalars, /*with_stderr=*/false);
  const auto j = nlohmann::json::parse(r.output);
  for (const auto& o : j["verify"]["outputs"]) {
    EXPECT_GT(o["nonfinite"].get<int64_t>(), 0) << o.dump();
    EXPECT_GT(o["ref_rms"].get<double>(), 1e60) << o.dump();  // the reference, also where the output overflowed
  }
  r = run("backward --verify none" + scalars);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "--verify tells an overflow of the output dtype from a defect")) << r.output;
}

TEST_F(Cli, BadUsageExitsWithTwo) {
  for (const std::string args : {"", "backward --bogus", "backward --preset nope", "backward --heads 7 --preset tiny",
                                 "backward --verify maybe", "generate --preset tiny",
                                 "backward --in x.safetensors --topk 4"}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
  }
  const Result unknown = run("frobnicate --preset tiny");
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_TRUE(contains(unknown.output, "unknown subcommand 'frobnicate': expected one of generate, backward, forward, step, bench, topk, presets"))
      << unknown.output;
  const Result none = run("");
  EXPECT_TRUE(contains(none.output, "a subcommand is required: one of generate, backward, forward, step, bench, topk, presets")) << none.output;
  const Result help = run("backward --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_TRUE(contains(help.output, "--preset")) << help.output;
  EXPECT_TRUE(contains(run("presets").output, "deepseek-v32"));
}

}  // namespace

namespace {

double f32_at(const dsaib::HostTensor& t, int64_t i) { return t.data<float>()[i]; }

}  // namespace

// Logits of ~10^4 (sm_scale 2000): the f32 row_lse alone is ~1e-3 from the exact
// LSE, so the check's bound carries |LSE|·2^-24 beside its 1e-5 (a fixed 1e-5
// fails every correct output here).
TEST_F(Cli, ForwardLseBoundAllowsTheF32RoundingOfALargeLse) {
  const Result r = run("forward --preset tiny --sm-scale 2000 --threads 2 --json", /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  bool seen = false;
  for (const auto& o : j["verify"]["outputs"]) {
    if (o["name"] != "row_lse") continue;
    seen = true;
    EXPECT_GT(o["max_abs"].get<double>(), 1e-5) << o.dump();  // the case this test is about
    EXPECT_GT(o["tolerance"].get<double>(), o["max_abs"].get<double>()) << o.dump();
    EXPECT_TRUE(o["pass"].get<bool>()) << o.dump();
  }
  EXPECT_TRUE(seen) << r.output;
  EXPECT_EQ(j["result"], "PASS");
}

TEST_F(Cli, ForwardVerifiesLossLseMassAndPAndWritesThem) {
  const std::string in = tiny_problem();
  const std::string out = path("forward.safetensors");
  const Result r = run("forward --in " + quote(in) + " --out " + quote(out) + " --threads 2 --json",
                       /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["op"], "forward");
  EXPECT_EQ(j["verify"]["mode"], "all");
  std::vector<std::string> names;
  for (const auto& o : j["verify"]["outputs"]) {
    names.push_back(o["name"]);
    EXPECT_TRUE(o["pass"].get<bool>()) << o.dump();
  }
  EXPECT_EQ(names, (std::vector<std::string>{"loss", "row_lse", "row_target_mass", "index_score"}));
  EXPECT_EQ(j["result"], "PASS");
  std::map<std::string, std::string> meta;
  const auto f = dsaib::read_safetensors(out, &meta);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(meta.at("op"), "forward");
  EXPECT_EQ(f.at("loss").shape, std::vector<int64_t>{});
  EXPECT_EQ(f.at("row_lse").shape, (std::vector<int64_t>{2, 64}));
  EXPECT_EQ(f.at("row_target_mass").shape, (std::vector<int64_t>{2, 64}));
  EXPECT_EQ(f.at("index_score").shape, (std::vector<int64_t>{2, 64, 16}));
  EXPECT_EQ(f32_at(f.at("loss"), 0), j["loss"].get<double>());
  // P against the generator's (the fp64 softmax of the same logits, rounded to f32), and
  // P = exp(z - LSE) sums to 1 per row
  const auto p = dsaib::read_safetensors(in);
  const dsaib::HostTensor& want = p.at("index_score");
  const dsaib::HostTensor& got = f.at("index_score");
  for (int64_t row = 0; row < 128; ++row) {
    double sum = 0;
    for (int64_t s = 0; s < 16; ++s) {
      const double g = f32_at(got, row * 16 + s), w = f32_at(want, row * 16 + s);
      sum += g;
      EXPECT_LE(std::abs(g - w), 1e-5 * w + 1e-30) << row << " " << s;
    }
    if (f32_at(f.at("row_lse"), row) > -INFINITY) EXPECT_NEAR(sum, 1.0, 1e-5) << row;
  }
}

/// forward and step compute P: a problem file without index_score is theirs to
/// read; backward needs it and says so, naming the tensor.
TEST_F(Cli, ForwardAndStepReadFilesWithoutIndexScore) {
  std::map<std::string, std::string> meta;
  auto tensors = dsaib::read_safetensors(tiny_problem(), &meta);
  ASSERT_EQ(tensors.erase("index_score"), 1u);
  const std::string in = path("tiny_without_p.safetensors");
  dsaib::write_safetensors(in, tensors, meta);
  for (const char* op : {"forward", "step"}) {
    const Result r = run(std::string(op) + " --in " + quote(in) + " --threads 2 --json", /*with_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << op << ": " << r.output;
    EXPECT_EQ(nlohmann::json::parse(r.output)["result"], "PASS") << op << ": " << r.output;
  }
  const Result bwd = run("backward --in " + quote(in) + " --threads 2");
  EXPECT_EQ(bwd.exit_code, 2) << bwd.output;
  EXPECT_TRUE(contains(bwd.output, "missing tensor 'index_score'")) << bwd.output;
}

TEST_F(Cli, StepEqualsForwardLossAndBackwardGradients) {
  const std::string in = tiny_problem();
  const std::string step = path("step.safetensors"), bwd = path("bwd.safetensors"), fwd = path("fwd.safetensors");
  const Result r = run("step --in " + quote(in) + " --out " + quote(step) + " --out-dtype f32 --verify all --json",
                       /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["op"], "step");
  std::vector<std::string> names;
  for (const auto& o : j["verify"]["outputs"]) {
    names.push_back(o["name"]);
    EXPECT_TRUE(o["pass"].get<bool>()) << o.dump();
  }
  EXPECT_EQ(names, (std::vector<std::string>{"loss", "d_index_q", "d_weights", "d_index_k"}));
  ASSERT_EQ(run("backward --in " + quote(in) + " --out " + quote(bwd) + " --out-dtype f32 --verify none").exit_code, 0);
  ASSERT_EQ(run("forward --in " + quote(in) + " --out " + quote(fwd) + " --verify none").exit_code, 0);
  const auto s = dsaib::read_safetensors(step), b = dsaib::read_safetensors(bwd), f = dsaib::read_safetensors(fwd);
  EXPECT_EQ(f32_at(s.at("loss"), 0), f32_at(f.at("loss"), 0));  // the same fp64 forward
  // the backward given the generator's P (the fp64 softmax in f32) and the one call's P-free backward
  for (const char* name : {"d_index_q", "d_weights", "d_index_k"}) {
    const auto& a = s.at(name);
    const auto& c = b.at(name);
    ASSERT_EQ(a.shape, c.shape) << name;
    double err2 = 0, ref2 = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      err2 += std::pow(f32_at(a, i) - f32_at(c, i), 2);
      ref2 += std::pow(f32_at(c, i), 2);
    }
    EXPECT_GT(ref2, 0.0) << name;
    EXPECT_LE(std::sqrt(err2 / ref2), 1e-5) << name;
  }
}

TEST_F(Cli, StepOnGeneratedThdGlobalIdsSampledAndForwardFlags) {
  const Result r = run("step --layout thd --seqlens-q 1,37,50 --heads 16 --head-dim 64 --topk 24 --id-mode global"
                       " --verify sample --sample-rows 8 --grad-loss 2.5 --json",
                       /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["problem"]["layout"], "thd");
  EXPECT_EQ(j["verify"]["mode"], "sample");
  ASSERT_EQ(j["verify"]["outputs"].size(), 4u);
  EXPECT_EQ(j["result"], "PASS");
  // the forward has no gradients: no --out-dtype, no sampled verification
  EXPECT_EQ(run("forward --preset tiny --out-dtype f32").exit_code, 2);
  const Result bad = run("forward --preset tiny --verify sample");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(contains(bad.output, "--verify")) << bad.output;
  const Result text = run("forward --preset tiny");
  EXPECT_EQ(text.exit_code, 0) << text.output;
  for (const char* frag : {"dsaib forward", "  loss        ", "  forward     ", "row_lse", "index_score",
                           "result      PASS"}) {
    EXPECT_TRUE(contains(text.output, frag)) << "'" << frag << "' not in:\n" << text.output;
  }
}

// forward and step compute P: a NaN or inf in the file's index_score is a
// tensor they never read, so it does not decide their verdict (backward reads
// it, and fails).
TEST_F(Cli, NonFiniteIndexScoreFailsOnlyTheOperationThatReadsIt) {
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  const int64_t topk = t.at("topk_indices").shape.back();
  t.at("index_score").data<float>()[0] = std::nanf("");  // row 0, slot 0: valid (causal ids)
  t.at("index_score").data<float>()[topk] = std::numeric_limits<float>::infinity();  // row 1, slot 0: valid
  const std::string in = path("nan_p.safetensors");
  dsaib::write_safetensors(in, t, meta);
  for (const char* op : {"forward", "step"}) {
    const Result r = run(std::string(op) + " --in " + quote(in) + " --threads 2 --json", /*with_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << op << ": " << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["result"], "PASS") << op << ": " << r.output;
    EXPECT_TRUE(j["nonfinite_inputs"].empty()) << op << ": " << r.output;
  }
  const Result bwd = run("backward --in " + quote(in) + " --threads 2 --verify none");
  EXPECT_EQ(bwd.exit_code, 1) << bwd.output;
  EXPECT_TRUE(contains(bwd.output, "FAIL (non-finite inputs: index_score: 2 (first at element 0))")) << bwd.output;
}

// Every id of every row names key 0: every slot's logit is the same, P is
// uniform, and with a uniform T the exact gradients are 0. The reference is
// then fp64 rounding noise; the verdict measures the error against the floor
// that the inputs scale (docs/errors.md), and passes.
TEST_F(Cli, ZeroGradientsPassAgainstTheInputScaledFloor) {
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  int32_t* ids = t.at("topk_indices").data<int32_t>();
  for (int64_t e = 0; e < t.at("topk_indices").numel(); ++e) ids[e] = 0;
  const int64_t topk = t.at("topk_indices").shape.back();
  float* target = t.at("attn_score").data<float>();
  float* p = t.at("index_score").data<float>();
  for (int64_t e = 0; e < t.at("attn_score").numel(); ++e) target[e] = p[e] = 1.0f / static_cast<float>(topk);
  const std::string in = path("all_ids_zero.safetensors");
  dsaib::write_safetensors(in, t, meta);
  for (const char* op : {"backward", "step"}) {
    const Result r = run(std::string(op) + " --in " + quote(in) + " --threads 2 --verify all --json", false);
    EXPECT_EQ(r.exit_code, 0) << op << ": " << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["result"], "PASS") << op << ": " << r.output;
    for (const auto& m : j["verify"]["outputs"]) {
      if (m["name"] == "loss" || m["name"] == "row_lse" || m["name"] == "row_target_mass" || m["name"] == "index_score") {
        continue;
      }
      EXPECT_GT(m["ref_floor"].get<double>(), 0.0) << op << ": " << m.dump();
      EXPECT_TRUE(std::isfinite(m["rel_rms"].get<double>())) << op << ": " << m.dump();
    }
  }
}

// A report that cannot be written is an error, not a silent exit 0.
TEST_F(Cli, AReportThatCannotBeWrittenExitsWithTwo) {
  if (std::filesystem::exists("/dev/full")) {
    const Result r = dsaib::test::run_command("sh -c " + quote(quote(DSAIB_CLI_PATH) + " step --preset tiny --json >/dev/full") +
                                              " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "the report could not be written to standard output")) << r.output;
  }
  const Result closed = dsaib::test::run_command(quote(DSAIB_CLI_PATH) + " presets >&- 2>&1");
  EXPECT_EQ(closed.exit_code, 2) << closed.output;
  const Result fine = run("presets");
  EXPECT_EQ(fine.exit_code, 0) << fine.output;
}

// bench sizes beyond what int32 ids and cu_seqlens address are errors naming the
// flag (not the shape of a tensor the flag made), before any GPU is needed.
TEST_F(Cli, BenchSizesBeyondInt32RowsNameTheirFlag) {
  const std::pair<const char*, const char*> cases[] = {{"--topk 9223372036854775807", "--topk"},
                                                       {"--batch 9223372036854775807", "--batch"},
                                                       {"--seq 4096,9223372036854775807", "--seq"},
                                                       {"--batch 65536 --seq 65536", "--seq"}};
  for (const auto& [flags, flag] : cases) {
    const Result r = run(std::string("bench ") + flags + " --json -", /*with_stderr=*/false);
    EXPECT_EQ(r.exit_code, 2) << flags << ": " << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["error"]["argument"], flag) << flags << ": " << r.output;
    EXPECT_TRUE(contains(j["error"]["message"].get<std::string>(), "2147483647")) << r.output;
  }
}

// The floor of a near-zero reference comes from the rows the operation reads:
// a huge key row that no valid slot selects (padding) must not loosen the check.
TEST_F(Cli, ReferenceFloorIgnoresRowsTheOperationDoesNotRead) {
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  const dsaib::HostTensor& ids = t.at("topk_indices");
  const int64_t s_kv = t.at("index_k").shape[1], d = t.at("index_k").shape[2], topk = ids.shape.back();
  std::vector<bool> selected(static_cast<size_t>(s_kv), false);
  for (int64_t e = 0; e < ids.numel() / 2; ++e) {  // batch 0's rows (local ids)
    if (ids.data<int32_t>()[e] >= 0) selected[static_cast<size_t>(ids.data<int32_t>()[e])] = true;
  }
  int64_t unread = -1;
  for (int64_t j = 0; j < s_kv && unread < 0; ++j) unread = selected[static_cast<size_t>(j)] ? -1 : j;
  ASSERT_GE(unread, 0) << "every key row of batch 0 is selected (topk " << topk << ")";
  for (int64_t e = 0; e < d; ++e) t.at("index_k").data<uint16_t>()[unread * d + e] = 0x7149;  // bf16 ~1e30
  const std::string in = path("huge_padding.safetensors");
  dsaib::write_safetensors(in, t, meta);
  const Result r = run("backward --in " + quote(in) + " --threads 2 --verify all --json", false);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const auto& m : nlohmann::json::parse(r.output)["verify"]["outputs"]) {
    EXPECT_LT(m["ref_floor"].get<double>(), 1e-3 * m["ref_rms"].get<double>()) << m.dump();
  }
}

// A loss below f32's normal range is judged beyond f32's resolution there.
TEST_F(Cli, SubnormalLossPassesWithinTheF32Resolution) {
  std::map<std::string, std::string> meta;
  auto t = dsaib::read_safetensors(tiny_problem(), &meta);
  float* target = t.at("attn_score").data<float>();
  for (int64_t e = 0; e < t.at("attn_score").numel(); ++e) target[e] = 0.0f;  // T~ = eps: a loss of ~1e-42
  const std::string in = path("zero_target.safetensors");
  dsaib::write_safetensors(in, t, meta);
  for (const char* op : {"forward", "step"}) {
    const Result r = run(std::string(op) + " --in " + quote(in) + " --threads 2 --json", false);
    EXPECT_EQ(r.exit_code, 0) << op << ": " << r.output;
  }
}
