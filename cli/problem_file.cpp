// Problem files of the CLI: writing a problem and reading one back, with its
// metadata's rules (the layout, id mode and scalars) and the gradients a
// producer may have stored beside the inputs.
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cli.hpp"
#include "dsaib/safetensors.hpp"

namespace dsaib::cli {
namespace {

double parse_number(const std::map<std::string, std::string>& meta, const std::string& key, double fallback,
                    const std::string& path, bool* found = nullptr) {
  const auto it = meta.find(key);
  if (found) *found = it != meta.end();
  if (it == meta.end()) return fallback;
  const std::string& s = it->second;
  double v = 0;
  if (!parse_number_text(s, &v) || !std::isfinite(v)) {
    throw Error(ErrorCode::invalid_argument, key,
                path + ": metadata " + key + ": expected a finite number, got \"" + s + "\"");
  }
  return v;
}

/// A metadata scalar that the op takes as fp32: parse_number's rules and
/// fits_fp32_scalar (cli.hpp), the rules of the CLI's flags.
float parse_fp32(const std::map<std::string, std::string>& meta, const std::string& key, double fallback,
                 const std::string& path, bool nonzero, bool* found = nullptr) {
  const double v = parse_number(meta, key, fallback, path, found);
  if (!fits_fp32_scalar(v, nonzero)) {
    throw Error(ErrorCode::invalid_argument, key,
                path + ": metadata " + key + ": expected a finite " + (nonzero ? "nonzero " : "") +
                    "number (fp32 range), got \"" + meta.at(key) + "\"");
  }
  return static_cast<float>(v);
}

}  // namespace

void save_problem(const std::string& path, const Problem& p) {
  std::map<std::string, std::string> meta = p.info;
  meta["sm_scale"] = format_float(p.options.sm_scale);
  meta["loss_coeff"] = format_float(p.options.loss_coeff);
  meta["grad_loss"] = format_float(p.options.grad_loss);
  meta["layout"] = layout_name(p.options.layout);
  meta["id_mode"] = id_mode_name(p.options.id_mode);
  if (p.options.normalization_count > 0) meta["normalization_count"] = std::to_string(p.options.normalization_count);
  write_safetensors(path, p.tensors, meta);
}

namespace {

/// Metadata keys of a problem file: the options load_problem reads, and what is kept for the report.
constexpr const char* kReadKeys[] = {"layout", "id_mode", "sm_scale", "loss_coeff", "grad_loss", "normalization_count"};
constexpr const char* kInfoKeys[] = {"generator", "preset", "ids", "seed"};
/// Gradients stored by the file's producer (torch_d_*, scripts/dump_torch_step.py
/// --with-grads), compared with ours after the run, and the input each is shaped like.
constexpr std::pair<const char*, const char*> kStoredGradients[] = {
    {"torch_d_index_q", "index_q"}, {"torch_d_weights", "weights"}, {"torch_d_index_k", "index_k"}};

/// Layout (from the metadata, else from the rank of index_q) and id mode.
void read_layout_and_id_mode(const std::map<std::string, std::string>& meta, const std::string& path, Problem& p) {
  const auto lay = meta.find("layout");
  if (lay != meta.end()) {
    if (lay->second == "bshd") p.options.layout = Layout::bshd;
    else if (lay->second == "thd") p.options.layout = Layout::thd;
    else bad("layout", path + ": metadata layout: expected bshd or thd, got \"" + lay->second + "\"");
  } else {
    p.options.layout = p.tensors.at("index_q").shape.size() == 3 ? Layout::thd : Layout::bshd;
  }
  const auto idm = meta.find("id_mode");
  if (idm != meta.end()) {
    if (idm->second == "local") p.options.id_mode = IdMode::local;
    else if (idm->second == "global") p.options.id_mode = IdMode::global;
    else bad("id_mode", path + ": metadata id_mode: expected local or global, got \"" + idm->second + "\"");
  }
}

/// The scalars; those a flag overrides are not read (a bad value there can be corrected by the flag).
void read_scalars(const std::map<std::string, std::string>& meta, const std::string& path,
                  const std::set<std::string>& overridden, Problem& p) {
  const HostTensor& q = p.tensors.at("index_q");
  const int64_t d = q.shape.empty() ? 0 : q.shape.back();
  const auto read = [&](const char* key) { return !overridden.count(key); };
  if (read("sm_scale")) {
    bool found = false;
    p.options.sm_scale = parse_fp32(meta, "sm_scale", d > 0 ? 1.0 / std::sqrt(double(d)) : 1.0, path, true, &found);
    if (!found) log_stage("note: " + path + " has no sm_scale metadata; using 1/sqrt(D) = " + format_float(p.options.sm_scale));
  }
  if (read("loss_coeff")) p.options.loss_coeff = parse_fp32(meta, "loss_coeff", 1.0, path, false);
  if (read("grad_loss")) p.options.grad_loss = parse_fp32(meta, "grad_loss", 1.0, path, false);
  const auto it = meta.find("normalization_count");
  if (read("normalization_count") && it != meta.end()) {
    // A decimal integer, read exactly (the --normalization-count flag's range;
    // what generate writes), not through a double.
    const std::string& text = it->second;
    int64_t n = -1;
    // The flags' decimal rule (cli.hpp), and no sign: "-0" is refused as "-1" is.
    if (!parse_decimal_int64(text, &n) || text[0] == '-') {
      bad("normalization_count", path + ": metadata normalization_count: expected a decimal integer in [0, " +
                                     std::to_string(std::numeric_limits<int64_t>::max()) + "], got \"" + text + "\"");
    }
    p.options.normalization_count = n;
  }
}

/// A misspelt key or tensor name is otherwise silently ignored: name what is.
void note_ignored(const std::map<std::string, std::string>& meta, const std::string& path, const Problem& p) {
  std::set<std::string> known_keys(std::begin(kReadKeys), std::end(kReadKeys));
  known_keys.insert(std::begin(kInfoKeys), std::end(kInfoKeys));
  known_keys.insert("format");  // written by some safetensors writers
  std::set<std::string> known_names(std::begin(kInputNames), std::end(kInputNames));
  known_names.insert(std::begin(kSeqlenNames), std::end(kSeqlenNames));
  for (const auto& entry : kStoredGradients) known_names.insert(entry.first);
  std::vector<std::string> unknown_keys, unknown_names;
  for (const auto& [key, value] : meta) {
    if (!known_keys.count(key)) unknown_keys.push_back(key);
  }
  for (const auto& [name, tensor] : p.tensors) {
    if (!known_names.count(name)) unknown_names.push_back(name);
  }
  std::string read;
  for (const char* key : kReadKeys) read += (read.empty() ? "" : ", ") + std::string(key);
  if (!unknown_keys.empty()) {
    log_stage("note: " + path + ": ignored metadata keys: " + short_list(unknown_keys) + " (read: " + read + ")");
  }
  if (!unknown_names.empty()) log_stage("note: " + path + ": ignored tensors: " + short_list(unknown_names));
}

/// A stored gradient that cannot be compared is an error here, not skipped after the run.
void check_stored_gradients(const std::string& path, const Problem& p) {
  for (const auto& [name, like] : kStoredGradients) {
    const auto it = p.tensors.find(name);
    if (it == p.tensors.end()) continue;
    const HostTensor& t = it->second;
    const HostTensor& ref = p.tensors.at(like);
    if (t.shape != ref.shape) {
      bad(name, path + ": " + name + ": expected shape " + shape_string(ref.shape) + " like " + like +
                    " (a stored gradient), got shape " + shape_string(t.shape));
    }
    if (t.dtype != DType::f32 && t.dtype != DType::bf16) {
      bad(name, path + ": " + name + ": expected dtype f32 or bf16 (a stored gradient), got dtype " + dtype_name(t.dtype));
    }
  }
}

}  // namespace

Problem load_problem(const std::string& path, const std::set<std::string>& overridden, bool index_score_required) {
  std::map<std::string, std::string> meta;
  Problem p;
  p.tensors = read_safetensors(path, &meta);
  p.origin = "file " + path;
  for (const char* name : kInputNames) {
    if (!index_score_required && std::string(name) == "index_score") continue;
    if (!p.tensors.count(name)) {
      throw Error(ErrorCode::invalid_argument, name,
                  path + ": missing tensor '" + name +
                      "' (a problem file holds index_q, weights, index_k, topk_indices, attn_score, index_score"
                      " (for backward; forward and step compute it) and, for THD, cu_seqlens_q and cu_seqlens_k)");
    }
  }
  read_layout_and_id_mode(meta, path, p);
  read_scalars(meta, path, overridden, p);
  for (const char* key : kInfoKeys) {
    if (meta.count(key)) p.info[key] = meta.at(key);
  }
  note_ignored(meta, path, p);
  check_stored_gradients(path, p);
  return p;
}

}  // namespace dsaib::cli
