#!/usr/bin/env bash
# The GPU check: everything in this repository that needs the GPU, in one command, on
# any machine with an sm_90 GPU (H100, H200) and a CUDA build of this checkout.
#
#   usage: scripts/gpu_check.sh [options] OUTDIR
#     -B, --build-dir DIR    the CUDA build to check (default: ./build)
#     --build                run `cmake --build DIR` first
#     --only PART[,PART...]  run only these parts (names below)
#     --skip-PART            skip one part: --skip-tests, --skip-sanitizer, --skip-cli,
#                            --skip-bench, --skip-target, --skip-topk, --skip-peers,
#                            --skip-forward-peers, --skip-target-peers, --skip-topk-peers, --skip-python,
#                            --skip-torch-step, --skip-megatron
#     --bench-args "ARGS"    more arguments for the bench part's dsaib-bench (e.g. "--seq 16384 --ids random")
#     --target-bench-args "ARGS"  more arguments for the target part's dsaib-bench (e.g. "--seq 4096 --shapes 128x576")
#     --topk-bench-args "ARGS"    more arguments for the topk part's timed dsaib-bench (e.g. "--topk-shapes 64x128
#                                 --ranges causal"; its S list is --topk-seq)
#     --peers-site DIR       a folder of peer packages to put first on sys.path (passed as --site)
#     --tilelang-example DIR TileLang's example files (default .peers/tilelang_example, see "peers")
#     --megatron-dir DIR     Megatron-Core's TileLang loss kernels (default .peers/megatron_tilelang,
#                            see "forward-peers")
#     --peers-seq LIST       S of the peers, forward-peers and target-peers parts (default 4096,16384,65536)
#     --topk-seq LIST        S of the topk and topk-peers parts' timed cases (default 16384,65536,131072)
#     -h, --help             this text
#
# Before it, once (the README's build):
#   export PATH=/usr/local/cuda/bin:$PATH
#   bash scripts/install_deps.sh
#   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSAIB_ENABLE_CUDA=ON
#   cmake --build build
#
# It first checks that the build has the cuda backend and its binaries, and that
# nvidia-smi shows a GPU of compute capability 9.0; without one it stops with exit 2
# (nothing is reported as passed). Then the parts, in this order, with these commands
# (B = the build folder, O = OUTDIR; every command's output is in O/PART/):
#
#   tests      ctest --test-dir B -L gpu --no-tests=error --output-on-failure
#              ctest --test-dir B -R '^install_and_consume$' --no-tests=error -V
#              The GPU tests (kernel numerics, determinism, graphs, the bench tools on tiny
#              shapes) must run, not skip: a test that skipped for want of a visible sm_90
#              GPU fails the part (the one test that needs two GPUs may skip). The
#              installed package's C++ consumer must pass on the cuda backend too.
#   sanitizer  bash tests/sanitizer/run_sanitizer.sh B/tests/sanitizer_bin O/sanitizer
#              compute-sanitizer racecheck, synccheck, memcheck and initcheck over the
#              Sanitized.* GPU tests, zero reports required; and the negative controls: the
#              lane-0-alone handoffs of sync_calibration must be flagged by racecheck, the
#              all-lanes ones must be clean. A missing compute-sanitizer fails the part.
#   cli        for each case i of CLI_CASES below (shapes, tails, layouts, id modes, dtypes,
#              a-operand precisions, scalars, strict ids, the deterministic mode):
#                B/cli/dsaib backward --backend cuda --verify all --seed $((1000 + i)) CASE --json
#              (a case that names --verify sample runs sampled rows instead), each against the
#              fp64 reference; then a problem file through the CLI:
#                B/cli/dsaib generate --preset b3-q64-k2048-random --seed 7 --out O/cli/b3-q64-k2048-random.safetensors
#                B/cli/dsaib backward --in O/cli/b3-q64-k2048-random.safetensors --backend cuda --verify all
#                                      --out O/cli/race2_grads.safetensors
#   bench      B/bench/dsaib-bench --op backward,forward,step,one-call --json O/bench/bench.json [--bench-args]
#              B/bench/dsaib-bench --op forward,one-call --topk-logits --json O/bench/bench_topk_logits.json
#                      [--bench-args]
#              The speed measurement of the indexer loss's ops: per case (DeepSeek shape H64
#              D128 topk 2048, S 4096 / 16384 / 65536, causal and random ids, each op) it
#              measures the floors the cases need (the scatter-add rate at each case's dK size,
#              the key gather of each case's ids, S, D and topk, the GEMM rate; each the best
#              of several ways, each way checked), then every op, in the same process, and
#              reports ns per query row and the ratio to that op's floor (xfloor);
#              `dsaib-bench --help` states the floors' formulas.
#   target     B/tests/gpu/test_gpu_attention_target
#              B/bench/dsaib-bench --op target --json O/target/bench.json [--target-bench-args]
#              The attention target: its GPU tests against the fp64 reference (also in the
#              tests part; here on their own, a skipped test failing the part), then its speed:
#              per case (Hq x Dqk 128 x 576 and 64 x 192, topk 2048, S 4096 / 16384 / 65536,
#              causal and random ids) ns per query row and the ratio to its floor, max(latent-key
#              gather, GEMM at the target's shape), measured in the same run.
#   topk       B/tests/gpu/test_gpu_indexer_topk
#              B/bench/dsaib-bench --op topk --seq 16384,65536,131072 --topk 2048 --json O/topk/bench.json
#                      [--topk-bench-args]
#              B/bench/dsaib-bench --op topk --seq 131072,262144 --topk 2048 --iters 3 --warmup 1
#                      --sustained-ms 0 --no-floor --json O/topk/memory.json
#              The indexer's top-k forward (indexer_topk): its GPU tests against the reference
#              selection (also in the tests part; here on their own, a skipped test failing the
#              part), then its speed: per case (--ranges causal and cp-shard x --topk-shapes 64x128
#              and 32x128 x S, topk 2048) ns per query row and the ratio to its floor (the logits'
#              FLOPs at the GEMM rate measured in the same run); then its memory at long S (the
#              workspace, the pool's high-water marks, the cudaMemGetInfo delta; no floor).
#   peers      the same problem in other implementations, each one skipped with its reason
#              when its packages are not installed (exit 77 and a JSON saying why):
#                python3 bench/peers/cudnn_frontend_dsa.py --check --seq 4096,16384,65536 --ids causal,random
#                        --iters 10 --warmup 2 --sustained-ms 2000 --json O/peers/cudnn_frontend.json
#                python3 bench/peers/tilelang_indexer_bwd.py --check --seq 4096,16384,65536 --ids causal,random
#                        --iters 10 --warmup 2 --json O/peers/tilelang.json
#                python3 bench/peers/torch_eager.py --check --seq 4096,16384,65536 --ids causal,random
#                        --iters 5 --warmup 1 --json O/peers/torch_eager.json
#                python3 bench/peers/side_by_side.py --ours O/bench/bench.json --op backward
#                        --peers O/peers/NAME.json ... --out O/peers/side_by_side.md
#                python3 scripts/plot_bench.py --ours O/bench/bench.json --peers O/peers/NAME.json ...
#                        --out O/peers/bench_vs_s.png
#              Measured with torch 2.11, nvidia-cudnn-frontend 1.32.0 with nvidia-cutlass-dsl
#              4.8.1, tilelang 0.1.15 (pip install nvidia-cudnn-frontend==1.32.0
#              nvidia-cutlass-dsl==4.8.1 tilelang==0.1.15). The TileLang peer runs TileLang's
#              own example, which is not in this repository: copy indexer_bwd.py, index.py and
#              utils.py of github.com/tile-ai/tilelang's examples/dsa_sparse_finetune/ into
#              .peers/tilelang_example/ (ignored by git) or pass --tilelang-example DIR.
#              A peer's own result (its gradient check failing, a case running out of memory)
#              is reported, never a failure of this check; a peer script refusing its
#              arguments (exit 2) is, and so is a peer that does the floor's work running faster
#              than ours' floor of the same case (side_by_side.py's floor check: the floor is
#              then wrong).
#   forward-peers  the loss forward, ours and its peers side by side, in one run:
#                B/bench/dsaib-bench --op forward --seq 4096,16384,65536 --ids causal,random --iters 10
#                        --warmup 2 --sustained-ms 0 --json O/forward-peers/ours.json
#                python3 bench/peers/loss_forward_peers.py --check --seq 4096,16384,65536 --ids causal,random
#                        --iters 10 --warmup 2 --json O/forward-peers/peers.json
#                python3 bench/peers/side_by_side.py --ours O/forward-peers/ours.json
#                        --peers O/forward-peers/peers.json --out O/forward-peers/side_by_side.md
#              Ours is the forward kernel with its floor (key gather, GEMM1) measured in the same
#              process; the peers (torch eager, cudnn-frontend's SM90 sparse indexer score
#              recompute, Megatron-Core's TileLang sparse KL kernel) are each checked against the
#              float64 closed form first; one that cannot run says why in peers.json. The TileLang
#              kernels are Megatron-Core's, not in this repository nor in a megatron-core release
#              on PyPI: copy tilelang_indexer_loss.py and tilelang_utils.py of
#              github.com/NVIDIA/Megatron-LM's megatron/core/transformer/experimental_attention_variant/ops/
#              into .peers/megatron_tilelang/ (ignored by git) or pass --megatron-dir DIR.
#   target-peers   the attention target T, ours and its peers side by side, in one run:
#                B/bench/dsaib-bench --op target --seq 4096,16384,65536 --ids causal,random
#                        --shapes 128x576,64x192 --topk 2048 --iters 10 --warmup 2 --sustained-ms 0
#                        --json O/target-peers/ours.json
#                python3 bench/peers/attention_target_peers.py --check --seq 4096,16384,65536
#                        --ids causal,random --shapes 128x576,64x192 --iters 10 --warmup 2
#                        --json O/target-peers/peers.json
#                python3 bench/peers/side_by_side.py [--ours O/target-peers/ours.json]
#                        --peers O/target-peers/peers.json --out O/target-peers/side_by_side.md
#              Peers: torch eager, cudnn-frontend's SM90 sparse attention score recompute,
#              Megatron-Core's TileLang sparse_indexer_target (same files as forward-peers).
#              For both parts, as for "peers": a peer's own result is reported, never a failure of
#              this check; a peer script refusing its arguments (exit 2), our bench failing, and a
#              peer that does the floor's work running faster than ours' floor (the table names it)
#              are.
#   topk-peers the indexer's top-k, ours (the topk part's O/topk/bench.json) and its peers side by side:
#                python3 bench/peers/topk_peers.py --check --seq 16384,65536,131072 --topk 2048
#                        --iters 10 --warmup 2 --json O/topk-peers/peers.json
#                python3 bench/peers/side_by_side.py [--ours O/topk/bench.json] --op topk
#                        --peers O/topk-peers/peers.json --out O/topk-peers/side_by_side.md
#              Peers: dsaib.torch.indexer_topk (the Python package, where installed: --peers-site),
#              torch chunked matmul and torch.topk (Megatron-Core's fallback), cudnn-frontend's SM90
#              indexer forward and top-k, DeepGEMM's fp8_mqa_logits and torch.topk; each checked on a
#              small problem against the float64 top-k first. Without the topk part in the same run
#              the table has no rows of ours. As for "peers": a peer's own result is reported, never
#              a failure of this check; a peer script refusing its arguments (exit 2) and a peer that
#              does the floor's work running faster than ours' floor (the table names it) are.
#   python     bash scripts/python_check.sh --install --cuda --require-cuda O/python
#              builds this checkout's Python package with the cuda backend into O/python/site,
#              runs python/tests (the GPU tests must run) and the training example on cpu and
#              cuda; see scripts/python_check.sh.
#   torch-step python3 bench/torch_step.py --check [--topk-logits] --seq 16384,65536 --ids causal,random
#                      --json O/torch-step/torch_step.json
#              dsaib.torch's autograd step in both gradient forms beside the one call (the
#              package the python part installed, O/python/site, when it ran in this run; else
#              the installed one): its check, then ns per query row of each form and each form's
#              ratio to the one call. Exit 77 (no CUDA for torch) fails the part. This part and
#              the next run the interpreter PYTHON names (default python3), as the python part.
#   megatron   for BACKEND in dsaib none (and cudnn where cudnn-frontend and flash_mla import,
#              from --peers-site where given):
#                python3 examples/megatron_dsa_gpt.py --backend BACKEND --steps 300 --csv O/megatron/BACKEND.csv
#              then python3 examples/megatron_dsa_gpt.py --plot O/megatron/*.csv --png O/megatron/curves.png
#              A tiny Megatron-Core GPT with DSA layers trained on one GPU per indexer backend
#              (same seed, data and initial weights), each run's mean step time and the
#              indexer's share of it in its log. Needs Python >= 3.12 with megatron-core 0.19:
#              without it the part is SKIPPED with the reason; dsaib or none failing fails it,
#              cudnn's own failure is reported only; the plot needs matplotlib (else skipped).
#
# Writes O/summary.txt (one line per part: PASS, FAIL or SKIPPED with the reason),
# O/gpu.txt (GPU, driver, toolkit, commit) and O/gpu_check.log (the console).
# Exit status: 0 every part that ran passed, 1 a part failed, 2 it cannot run here (bad
# usage, no CUDA build, no sm_90 GPU).

# shellcheck disable=SC2317  # the part_* functions are called by name
set -uo pipefail

# The CLI matrix: one case per line, flags of `dsaib backward`.
CLI_CASES=(
  "--preset b1-q1-k512-random"
  "--preset b3-q64-k2048-random"
  "--preset b1-s512-causal"
  "--preset thd"
  "--preset thd --id-mode global"
  "--layout thd --seqlens-q 0,5,300,1 --seqlens-k 7,0,300,2 --heads 64 --head-dim 128 --topk 128"
  "--layout thd --seqlens-q 0,5,300,1 --seqlens-k 7,0,300,2 --heads 64 --head-dim 128 --topk 128 --id-mode global"
  "--s-q 5 --s-kv 100 --topk 2048 --heads 64 --head-dim 128"
  "--s-q 1 --s-kv 1 --topk 1 --heads 64 --head-dim 128"
  "--batch 3 --s-q 64 --s-kv 2048 --topk 512 --ids permutation --id-mode global"
  "--batch 3 --s-q 64 --s-kv 2048 --topk 512 --ids permutation"
  "--s-q 256 --s-kv 2304 --topk 1"
  "--s-q 256 --s-kv 2304 --topk 100"
  "--s-q 256 --s-kv 2304 --topk 129"
  "--s-q 256 --s-kv 2304 --topk 1000"
  "--s-q 256 --s-kv 2304 --topk 2176"
  "--s-q 256 --s-kv 2304 --topk 2176 --ids permutation"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 8"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 16"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 32"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 72"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 128"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 128 --head-dim 64"
  "--s-q 256 --s-kv 2048 --topk 512 --head-dim 64 --ids permutation"
  "--s-q 256 --s-kv 2048 --topk 512 --out-dtype f32"
  "--s-q 256 --s-kv 2048 --topk 512 --out-dtype f32 --head-dim 64 --weights-f32"
  "--s-q 256 --s-kv 2048 --topk 512 --a-operand bf16x2"
  "--s-q 256 --s-kv 2048 --topk 512 --a-operand bf16 --weights-f32"
  "--s-q 256 --s-kv 2048 --topk 512 --normalization-count 7 --loss-coeff -2.5 --grad-loss 0.75 --sm-scale 0.3"
  "--s-q 256 --s-kv 2048 --topk 512 --strict-indices"
  "--preset small"
  "--batch 2 --s-q 8192 --topk 2048 --heads 64 --head-dim 128 --verify sample"
  "--preset deepseek-v32 --verify sample --repeat 10"
  "--preset thd --id-mode global --deterministic"
  "--s-q 256 --s-kv 2048 --topk 512 --out-dtype f32 --deterministic"
  "--s-q 256 --s-kv 2048 --topk 512 --head-dim 64 --ids permutation --deterministic"
  "--preset deepseek-v32 --verify sample --deterministic"
)
# Cases of the launch options (L2 hints on the dK reductions, the start stagger): run when
# the CLI has the flag, listed as not run otherwise.
CLI_OPTION_CASES=(
  "--s-q 256 --s-kv 2048 --topk 512 --l2-hints on"
  "--s-q 256 --s-kv 2048 --topk 512 --l2-hints off"
  "--preset deepseek-v32 --verify sample --l2-hints off"
  "--preset deepseek-v32 --verify sample --start-stagger off"
)
PEER_SEQS=4096,16384,65536
PEER_IDS=causal,random
TARGET_SHAPES=128x576,64x192
TOPK_SEQS=16384,65536,131072

usage() { sed -n '2,/^$/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_check: $*" >&2; exit 2; }

ALL_PARTS=(tests sanitizer cli bench target topk peers forward-peers target-peers topk-peers python torch-step
           megatron)
declare -A run_part=()
for p in "${ALL_PARTS[@]}"; do run_part[$p]=1; done
build_dir=./build
do_build=0
bench_args=""
target_bench_args=""
topk_bench_args=""
peers_site=""
tilelang_example=""
megatron_dir=""
outdir=""
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    -B | --build-dir) [[ $# -ge 2 ]] || die "$1: expected a folder"; build_dir=$2; shift ;;
    --build-dir=*) build_dir=${1#*=} ;;
    --build) do_build=1 ;;
    --only)
      [[ $# -ge 2 ]] || die "--only: expected a comma-separated list of parts (${ALL_PARTS[*]})"
      for p in "${ALL_PARTS[@]}"; do run_part[$p]=0; done
      IFS=, read -r -a only <<<"$2"
      [[ ${#only[@]} -gt 0 ]] || die "--only: expected a comma-separated list of parts (${ALL_PARTS[*]}), got \"$2\""
      for p in "${only[@]}"; do
        [[ -n ${run_part[$p]+x} ]] || die "--only: unknown part \"$p\"; the parts are: ${ALL_PARTS[*]}"
        run_part[$p]=1
      done
      shift ;;
    --skip-*)
      p=${1#--skip-}
      [[ -n ${run_part[$p]+x} ]] || die "unknown option $1; the parts are: ${ALL_PARTS[*]}"
      run_part[$p]=0 ;;
    --bench-args) [[ $# -ge 2 ]] || die "--bench-args: expected a string of arguments"; bench_args=$2; shift ;;
    --target-bench-args) [[ $# -ge 2 ]] || die "--target-bench-args: expected a string of arguments"; target_bench_args=$2; shift ;;
    --topk-bench-args) [[ $# -ge 2 ]] || die "--topk-bench-args: expected a string of arguments"; topk_bench_args=$2; shift ;;
    --peers-site) [[ $# -ge 2 ]] || die "--peers-site: expected a folder"; peers_site=$2; shift ;;
    --tilelang-example) [[ $# -ge 2 ]] || die "--tilelang-example: expected a folder"; tilelang_example=$2; shift ;;
    --megatron-dir) [[ $# -ge 2 ]] || die "--megatron-dir: expected a folder"; megatron_dir=$2; shift ;;
    --peers-seq)
      [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
        die "--peers-seq: expected a comma-separated list of positive sequence lengths, got \"${2:-}\""
      PEER_SEQS=$2; shift ;;
    --topk-seq)
      [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
        die "--topk-seq: expected a comma-separated list of positive sequence lengths, got \"${2:-}\""
      TOPK_SEQS=$2; shift ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z $outdir ]] || die "one OUTDIR expected, got \"$outdir\" and \"$1\""; outdir=$1 ;;
  esac
  shift
done
[[ -n $outdir ]] || die "missing OUTDIR (usage: scripts/gpu_check.sh [options] OUTDIR; see --help)"

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -d $build_dir ]] || die "build folder $build_dir not found: configure and build first (see --help), or pass -B DIR"
build=$(cd "$build_dir" && pwd)
mkdir -p "$outdir" || die "cannot create OUTDIR $outdir"
out=$(cd "$outdir" && pwd)
[[ -n $peers_site ]] && peers_site=$(realpath -m "$peers_site")
[[ -n $tilelang_example ]] && tilelang_example=$(realpath -m "$tilelang_example")
[[ -n $megatron_dir ]] && megatron_dir=$(realpath -m "$megatron_dir")
cd "$repo" || exit 2
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

: >"$out/summary.txt"
exec > >(tee "$out/gpu_check.log") 2>&1
tee_pid=$!

failed=0
# record PART PASS|FAIL|SKIPPED DETAIL: one line of summary.txt
record() {
  printf '%-10s %-7s %s\n' "$1" "$2" "$3" | tee -a "$out/summary.txt"
  [[ $2 == FAIL ]] && failed=1
  return 0
}
banner() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }
finish() {
  echo
  echo "=== summary ($out/summary.txt)"
  cat "$out/summary.txt"
  echo "gpu_check: $([[ $failed == 0 ]] && echo PASSED || echo FAILED); logs in $out"
  exec 1>&- 2>&-
  wait "$tee_pid" 2>/dev/null
  exit "$1"
}
cannot_run() { echo "gpu_check: $*"; record setup FAIL "$*"; failed=1; finish 2; }

# ---------------------------------------------------------------- preflight
banner "preflight"
[[ -f $build/CMakeCache.txt ]] || cannot_run "$build is not a CMake build folder (no CMakeCache.txt)"
if ! grep -Eq '^DSAIB_ENABLE_CUDA:BOOL=(ON|TRUE|1)$' "$build/CMakeCache.txt" ||
  ! grep -Eq '^CMAKE_CUDA_COMPILER:[A-Z]+=/' "$build/CMakeCache.txt"; then
  cannot_run "$build has no cuda backend: configure it with -DDSAIB_ENABLE_CUDA=ON and nvcc on PATH"
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
  cannot_run "no sm_90 GPU: nvidia-smi not found (no NVIDIA driver on this machine)"
fi
gpus=$(nvidia-smi --query-gpu=index,name,compute_cap --format=csv,noheader 2>&1) ||
  cannot_run "no sm_90 GPU: nvidia-smi cannot list the GPUs ($(echo "$gpus" | head -2 | tr '\n' ' '))"
if ! awk -F', *' '$3 == "9.0" {found = 1} END {exit !found}' <<<"$gpus"; then
  cannot_run "no sm_90 GPU: the kernels need compute capability 9.0 (H100, H200); nvidia-smi lists: $(echo "${gpus:-none}" | tr '\n' ';')"
fi
if [[ $do_build == 1 ]]; then
  echo "cmake --build $build"
  cmake --build "$build" >"$out/build.log" 2>&1 || cannot_run "cmake --build $build failed (tail of $out/build.log: $(tail -3 "$out/build.log" | tr '\n' ' '))"
fi
need=()
# the CLI: every part but bench, target, topk, forward-peers, target-peers and topk-peers runs or needs it
for p in tests sanitizer cli peers python; do
  [[ ${run_part[$p]} == 1 ]] && need=(cli/dsaib) && break
done
[[ ${run_part[tests]} == 1 || ${run_part[sanitizer]} == 1 ]] && need+=(tests/gpu/test_gpu_hopper tests/gpu/test_gpu_bench)
[[ ${run_part[sanitizer]} == 1 ]] && need+=(tests/sanitizer_bin/test_gpu_hopper tests/sanitizer_bin/test_gpu_kl_forward tests/sanitizer_bin/test_gpu_attention_target tests/sanitizer_bin/test_gpu_indexer_topk tests/sanitizer_bin/sync_calibration)
for p in bench target topk forward-peers target-peers; do
  [[ ${run_part[$p]} == 1 ]] && need+=(bench/dsaib-bench) && break
done
[[ ${run_part[target]} == 1 ]] && need+=(tests/gpu/test_gpu_attention_target)
[[ ${run_part[topk]} == 1 ]] && need+=(tests/gpu/test_gpu_indexer_topk)
for f in "${need[@]}"; do
  [[ -x $build/$f ]] || cannot_run "$build/$f is missing: build the whole project (cmake --build $build, or pass --build)"
done
cli=$build/cli/dsaib
if [[ ${run_part[cli]} == 1 || ${run_part[peers]} == 1 || ${run_part[python]} == 1 ||
  ${run_part[forward-peers]} == 1 || ${run_part[target-peers]} == 1 || ${run_part[topk-peers]} == 1 ||
  ${run_part[torch-step]} == 1 || ${run_part[megatron]} == 1 ]]; then
  command -v "$py" >/dev/null 2>&1 || cannot_run "$py not found (the cli, peers, forward-peers, target-peers, topk-peers, python, torch-step and megatron parts need it; PYTHON=... names another)"
fi

{
  echo "date      $(date -u +%FT%TZ)"
  echo "commit    $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "build     $build ($(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt"))"
  echo "nvcc      $(nvcc --version 2>/dev/null | sed -n 's/^Cuda compilation tools, //p')"
  [[ -n ${CUDA_VISIBLE_DEVICES:-} ]] && echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
  nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
} >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
selected=()
for p in "${ALL_PARTS[@]}"; do [[ ${run_part[$p]} == 1 ]] && selected+=("$p"); done
echo "parts: ${selected[*]:-none}"

# ---------------------------------------------------------------- tests
part_tests() {
  local d=$out/tests rc crc
  mkdir -p "$d"
  banner "tests: ctest -L gpu"
  ctest --test-dir "$build" -L gpu --no-tests=error --output-on-failure >"$d/ctest_gpu.txt" 2>&1
  rc=$?
  cp "$build/Testing/Temporary/LastTest.log" "$d/ctest_gpu_full.log" 2>/dev/null
  tail -n 25 "$d/ctest_gpu.txt"
  local line skipped=""
  line=$(grep -E "tests passed, [0-9]+ tests failed out of" "$d/ctest_gpu.txt" | tail -1)
  if grep -q "no compute-capability-9.0 GPU visible" "$d/ctest_gpu_full.log" 2>/dev/null; then
    skipped=$(grep -c "(Skipped)" "$d/ctest_gpu.txt")
    record tests FAIL "$skipped GPU tests skipped, saying no sm_90 GPU is visible, although nvidia-smi lists one (CUDA_VISIBLE_DEVICES? see $d/ctest_gpu_full.log)"
    return
  fi
  if [[ $rc -ne 0 ]]; then
    record tests FAIL "ctest -L gpu exit $rc: ${line:-no summary} (see $d/ctest_gpu.txt)"
    return
  fi
  banner "tests: the installed package's consumer (ctest -R install_and_consume)"
  ctest --test-dir "$build" -R '^install_and_consume$' --no-tests=error -V >"$d/install_and_consume.txt" 2>&1
  crc=$?
  grep -E "consumer_(cxx|c):|install_and_consume:" "$d/install_and_consume.txt" | sed 's/^[0-9]*: //' | tail -8
  if [[ $crc -ne 0 ]]; then
    record tests FAIL "GPU tests passed (${line}); install_and_consume exit $crc (see $d/install_and_consume.txt)"
  elif ! grep -q "PASS (cpu and cuda backends)" "$d/install_and_consume.txt"; then
    record tests FAIL "GPU tests passed (${line}); the installed package's consumer did not run the cuda backend (see $d/install_and_consume.txt)"
  else
    record tests PASS "${line}; installed-package consumer passed on the cpu and cuda backends"
  fi
}

# ---------------------------------------------------------------- sanitizer
part_sanitizer() {
  local d=$out/sanitizer rc
  mkdir -p "$d"
  banner "sanitizer: tests/sanitizer/run_sanitizer.sh (racecheck, synccheck, memcheck, initcheck; negative controls)"
  timeout -k 10 3600 bash tests/sanitizer/run_sanitizer.sh "$build/tests/sanitizer_bin" "$d" >"$d/run_sanitizer.txt" 2>&1
  rc=$?
  tail -n 12 "$d/run_sanitizer.txt"
  case $rc in
    0) record sanitizer PASS "zero reports under 4 tools; negative controls flagged, positive controls clean" ;;
    77) record sanitizer FAIL "not run: $(grep SKIPPED "$d/run_sanitizer.txt" | head -1) (install compute-sanitizer, part of the CUDA toolkit)" ;;
    124 | 137) record sanitizer FAIL "timed out after an hour (see $d)" ;;
    *) record sanitizer FAIL "exit $rc: $(grep -E 'FAILED|NOT FLAGGED|FLAGGED \(' "$d/sanitizer_summary.txt" 2>/dev/null | tr '\n' ';') (see $d)" ;;
  esac
}

# ---------------------------------------------------------------- cli
# case_line JSON: "MODE RMS_Q / RMS_W / RMS_K RESULT" of one --json report
case_line() {
  "$py" - "$1" <<'EOF'
import json, sys
try:
    j = json.loads(sys.argv[1])
except ValueError:
    print("no JSON report"); sys.exit()
if "error" in j:
    print("ERROR " + j["error"].get("message", "")); sys.exit()
v = j.get("verify", {})
rms = " / ".join("%.2e" % o["rel_rms"] if o.get("rel_rms") is not None else "nan" for o in v.get("outputs", []))
print("%s %s  %s" % (v.get("mode"), rms, j.get("result")))
EOF
}
part_cli() {
  local d=$out/cli pass=0 fail=0 notrun=0 i c verify json rc line flag
  mkdir -p "$d"
  banner "cli: dsaib backward --backend cuda against the fp64 reference, ${#CLI_CASES[@]} + ${#CLI_OPTION_CASES[@]} cases"
  local help
  help=$("$cli" backward --help 2>&1)
  {
    echo "dsaib backward --backend cuda, per case: verify mode, relative RMS of d_index_q / d_weights / d_index_k, result"
    local all=("${CLI_CASES[@]}" "${CLI_OPTION_CASES[@]}")
    for i in "${!all[@]}"; do
      c=${all[$i]}
      flag=$(grep -oE -- '--(l2-hints|start-stagger)' <<<"$c" | head -1)
      if [[ -n $flag && $help != *"$flag"* ]]; then
        printf '%-110s %s\n' "$c" "not run: this CLI has no $flag"
        notrun=$((notrun + 1))
        continue
      fi
      verify=all
      [[ $c == *"--verify"* ]] && verify=
      # shellcheck disable=SC2086  # a case is a list of flags
      json=$(timeout 300 "$cli" backward --backend cuda ${verify:+--verify $verify} --seed $((1000 + i)) $c --json 2>>"$d/stderr.txt")
      rc=$?
      line=$(case_line "$json")
      if [[ $rc -eq 0 && $line == *"PASS"* ]]; then pass=$((pass + 1)); else fail=$((fail + 1)); line="$line (exit $rc)"; fi
      printf '%-110s %s\n' "$c" "$line"
    done
    echo "--- a problem file: generate, then backward --in FILE --out FILE"
    if "$cli" generate --preset b3-q64-k2048-random --seed 7 --out "$d/b3-q64-k2048-random.safetensors" >"$d/generate.txt" 2>&1 &&
      timeout 300 "$cli" backward --in "$d/b3-q64-k2048-random.safetensors" --backend cuda --verify all \
        --out "$d/race2_grads.safetensors" >"$d/file_case.txt" 2>&1 && [[ -s $d/race2_grads.safetensors ]]; then
      pass=$((pass + 1))
      echo "file round trip: PASS ($d/file_case.txt)"
    else
      fail=$((fail + 1))
      echo "file round trip: FAIL (see $d/generate.txt, $d/file_case.txt)"
    fi
    echo "cases: $pass passed, $fail not, $notrun not run"
  } 2>&1 | tee "$d/cli_matrix.txt"
  line=$(tail -1 "$d/cli_matrix.txt")
  if [[ $line =~ ^cases:\ ([0-9]+)\ passed,\ 0\ not ]]; then
    record cli PASS "${line#cases: }"
  else
    record cli FAIL "${line#cases: } (see $d/cli_matrix.txt)"
  fi
}

# ---------------------------------------------------------------- bench
part_bench() {
  local d=$out/bench rc
  mkdir -p "$d"
  banner "bench: dsaib-bench --op backward,forward,step,one-call (the floors, then every op, in one run) ${bench_args}"
  # shellcheck disable=SC2086  # --bench-args is a list of flags
  timeout 3600 "$build/bench/dsaib-bench" --op backward,forward,step,one-call --json "$d/bench.json" $bench_args \
    >"$d/bench.txt" 2>"$d/bench_stderr.txt"
  rc=$?
  cat "$d/bench.txt"
  if [[ $rc -ne 0 ]]; then
    # exit 1: a floor's correctness check failed (or a CUDA error)
    record bench FAIL "dsaib-bench exit $rc ($(tail -1 "$d/bench_stderr.txt"))"
    return
  fi
  # The forward and the one call given the top-k's logits (no floor for the forward: see its --help)
  banner "bench: dsaib-bench --op forward,one-call --topk-logits ${bench_args}"
  # shellcheck disable=SC2086
  timeout 3600 "$build/bench/dsaib-bench" --op forward,one-call --topk-logits --json "$d/bench_topk_logits.json" \
    $bench_args >"$d/bench_topk_logits.txt" 2>"$d/bench_topk_logits_stderr.txt"
  rc=$?
  cat "$d/bench_topk_logits.txt"
  if [[ $rc -ne 0 ]]; then
    record bench FAIL "dsaib-bench --topk-logits exit $rc ($(tail -1 "$d/bench_topk_logits_stderr.txt"))"
  else
    record bench PASS "ns/row and ratio to each op's floor measured in the same run: $d/bench.txt, $d/bench.json; from the top-k's logits: $d/bench_topk_logits.txt"
  fi
}

# ---------------------------------------------------------------- target
part_target() {
  local d=$out/target rc brc line
  mkdir -p "$d"
  banner "target: test_gpu_attention_target (the attention target against the fp64 reference)"
  timeout 1200 "$build/tests/gpu/test_gpu_attention_target" >"$d/tests.txt" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|SKIPPED) |^\[  PASSED|tests ran" "$d/tests.txt" | tail -n 20
  line=$(grep -E "^\[==========\] [0-9]+ tests? from .* ran" "$d/tests.txt" | tail -1)
  banner "target: dsaib-bench --op target (the attention target and its floor in one run) ${target_bench_args}"
  # shellcheck disable=SC2086  # --target-bench-args is a list of flags
  timeout 1800 "$build/bench/dsaib-bench" --op target --json "$d/bench.json" $target_bench_args >"$d/bench.txt" \
    2>"$d/bench_stderr.txt"
  brc=$?
  cat "$d/bench.txt"
  if [[ $rc -ne 0 ]]; then
    record target FAIL "test_gpu_attention_target exit $rc: $(grep -c '^\[  FAILED  \]' "$d/tests.txt") failed lines (see $d/tests.txt); dsaib-bench exit $brc"
  elif grep -q "^\[  SKIPPED \]" "$d/tests.txt"; then
    record target FAIL "test_gpu_attention_target skipped tests (no visible sm_90 GPU? see $d/tests.txt)"
  elif [[ $brc -ne 0 ]]; then
    record target FAIL "GPU tests passed (${line}); dsaib-bench exit $brc ($(tail -1 "$d/bench_stderr.txt"))"
  else
    record target PASS "GPU tests passed (${line}); ns/row and ratio to the floor: $d/bench.txt, $d/bench.json"
  fi
}

# ---------------------------------------------------------------- topk
part_topk() {
  local d=$out/topk rc brc mrc line
  mkdir -p "$d"
  banner "topk: test_gpu_indexer_topk (the indexer's top-k against the reference selection)"
  timeout 1200 "$build/tests/gpu/test_gpu_indexer_topk" >"$d/tests.txt" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|SKIPPED) |^\[  PASSED|tests ran" "$d/tests.txt" | tail -n 20
  line=$(grep -E "^\[==========\] [0-9]+ tests? from .* ran" "$d/tests.txt" | tail -1)
  banner "topk: dsaib-bench --op topk --seq $TOPK_SEQS (the top-k and its floor in one run) ${topk_bench_args}"
  # shellcheck disable=SC2086  # --topk-bench-args is a list of flags
  timeout 1800 "$build/bench/dsaib-bench" --op topk --seq "$TOPK_SEQS" --topk 2048 --json "$d/bench.json" \
    $topk_bench_args >"$d/bench.txt" 2>"$d/bench_stderr.txt"
  brc=$?
  cat "$d/bench.txt"
  banner "topk: dsaib-bench --op topk --seq 131072,262144 (the memory at long S, no floor)"
  timeout 1200 "$build/bench/dsaib-bench" --op topk --seq 131072,262144 --topk 2048 --iters 3 --warmup 1 \
    --sustained-ms 0 --no-floor --json "$d/memory.json" >"$d/memory.txt" 2>"$d/memory_stderr.txt"
  mrc=$?
  cat "$d/memory.txt"
  if [[ $rc -ne 0 ]]; then
    record topk FAIL "test_gpu_indexer_topk exit $rc: $(grep -c '^\[  FAILED  \]' "$d/tests.txt") failed lines (see $d/tests.txt); dsaib-bench exit $brc, memory run exit $mrc"
  elif grep -q "^\[  SKIPPED \]" "$d/tests.txt"; then
    record topk FAIL "test_gpu_indexer_topk skipped tests (no visible sm_90 GPU? see $d/tests.txt)"
  elif [[ $brc -ne 0 ]]; then
    record topk FAIL "GPU tests passed (${line}); dsaib-bench exit $brc ($(tail -1 "$d/bench_stderr.txt"))"
  elif [[ $mrc -ne 0 ]]; then
    record topk FAIL "GPU tests passed (${line}); bench ran; the memory run exit $mrc ($(tail -1 "$d/memory_stderr.txt"))"
  else
    record topk PASS "GPU tests passed (${line}); ns/row and ratio to the floor: $d/bench.txt, $d/bench.json; memory: $d/memory.txt, $d/memory.json"
  fi
}

# ---------------------------------------------------------------- peers
part_peers() {
  local d=$out/peers rc name script args reason plot_args=() ran=0 bad=0 notes=() f
  mkdir -p "$d"
  local site_args=()
  [[ -n $peers_site ]] && site_args=(--site "$peers_site")
  for name in cudnn_frontend tilelang torch_eager; do
    case $name in
      cudnn_frontend) script=bench/peers/cudnn_frontend_dsa.py
        args=(--iters 10 --warmup 2 --sustained-ms 2000 "${site_args[@]}") ;;
      tilelang) script=bench/peers/tilelang_indexer_bwd.py
        args=(--iters 10 --warmup 2 "${site_args[@]}")
        [[ -n $tilelang_example ]] && args+=(--example-dir "$tilelang_example") ;;
      torch_eager) script=bench/peers/torch_eager.py
        args=(--iters 5 --warmup 1) ;;
    esac
    banner "peers: $name ($script)"
    rm -f "$d/$name.json"
    timeout -k 10 1200 "$py" "$script" --check --seq "$PEER_SEQS" --ids "$PEER_IDS" "${args[@]}" \
      --json "$d/$name.json" >"$d/$name.txt" 2>&1
    rc=$?
    tail -n 12 "$d/$name.txt"
    reason=$("$py" -c 'import json, sys; j = json.load(open(sys.argv[1])); print(j.get("reason") or "")' \
      "$d/$name.json" 2>/dev/null)
    case $rc in
      0) notes+=("$name ran"); ran=$((ran + 1)); plot_args+=(--peers "$d/$name.json") ;;
      77) notes+=("$name skipped: ${reason:-unavailable (see $d/$name.txt)}") ;;
      2) notes+=("$name refused its arguments (see $d/$name.txt)"); bad=1 ;;
      *) notes+=("$name ran with errors (exit $rc$( ((rc == 124 || rc == 137)) && echo ', timed out'): a failed --check or case; see $d/$name.txt)")
        [[ -s $d/$name.json ]] && plot_args+=(--peers "$d/$name.json") && ran=$((ran + 1)) ;;
    esac
  done
  if ((ran > 0)) && [[ -s $out/bench/bench.json ]]; then
    local side_args=()
    for f in "${plot_args[@]}"; do [[ $f == --peers ]] || side_args+=(--peers "$f"); done
    banner "peers: side by side with ours and the floor check (bench/peers/side_by_side.py)"
    "$py" bench/peers/side_by_side.py --ours "$out/bench/bench.json" --op backward "${side_args[@]}" \
      --out "$d/side_by_side.md" >/dev/null 2>"$d/floor_check.txt"
    case $? in
      0) notes+=("floor check passed; table $d/side_by_side.md") ;;
      1) notes+=("FLOOR CHECK FAILED: $(sed 's/^side_by_side: floor check FAILED: //' "$d/floor_check.txt" | tr '\n' ';')")
        bad=1 ;;
      *) notes+=("side by side failed (see $d/floor_check.txt)") ;;
    esac
  fi
  if ((ran > 0)); then
    [[ -s $out/bench/bench.json ]] && plot_args+=(--ours "$out/bench/bench.json" --op backward)
    banner "peers: plot (scripts/plot_bench.py)"
    if ! "$py" -c 'import matplotlib' 2>/dev/null; then
      notes+=("plot not drawn: matplotlib not installed")
    elif timeout 120 "$py" scripts/plot_bench.py "${plot_args[@]}" --out "$d/bench_vs_s.png" >"$d/plot.txt" 2>&1; then
      notes+=("plot $d/bench_vs_s.png")
    else
      notes+=("plot failed (see $d/plot.txt)")
    fi
  fi
  local joined
  joined=$(printf '%s; ' "${notes[@]}")
  if ((bad)); then
    record peers FAIL "${joined%; }"
  elif ((ran == 0)); then
    record peers SKIPPED "${joined%; }"
  else
    record peers PASS "${joined%; }"
  fi
}

# ---------------------------------------------------------------- forward-peers, target-peers, topk-peers
# Ours for one problem: ours_PART DIR writes DIR/ours.json and DIR/ours.txt; returns 0 when it
# ran, another status when it failed. The JSON (dsaib-bench's report: cases with ids, seq,
# heads, dim, topk, ns_per_row and floor.ns_per_row) is what bench/peers/side_by_side.py reads.
ours_forward_peers() {
  timeout 900 "$build/bench/dsaib-bench" --op forward --seq "$PEER_SEQS" --ids "$PEER_IDS" --iters 10 --warmup 2 \
    --sustained-ms 0 --json "$1/ours.json" >"$1/ours.txt" 2>&1
}
ours_target_peers() {
  timeout 900 "$build/bench/dsaib-bench" --op target --seq "$PEER_SEQS" --ids "$PEER_IDS" --shapes "$TARGET_SHAPES" \
    --topk 2048 --iters 10 --warmup 2 --sustained-ms 0 --json "$1/ours.json" >"$1/ours.txt" 2>&1
}
# problem_peers PART SCRIPT [ARGS...]: ours, then the peers script, then the table of both
problem_peers() {
  local part=$1 script=$2 d=$out/$1 rc orc reason ours_note side_args=()
  shift 2
  mkdir -p "$d"
  local peer_args=()
  [[ -n $peers_site ]] && peer_args+=(--site "$peers_site")
  [[ -n $megatron_dir ]] && peer_args+=(--megatron-dir "$megatron_dir")
  banner "$part: ours"
  rm -f "$d/ours.json" "$d/peers.json"
  "ours_${part//-/_}" "$d"
  orc=$?
  tail -n 20 "$d/ours.txt"
  case $orc in
    0) ours_note="ours ran"; side_args+=(--ours "$d/ours.json") ;;
    *) ours_note="ours FAILED (exit $orc, see $d/ours.txt)" ;;
  esac
  banner "$part: peers ($script)"
  timeout -k 10 1500 "$py" "$script" --check --seq "$PEER_SEQS" --ids "$PEER_IDS" "$@" "${peer_args[@]}" \
    --json "$d/peers.json" >"$d/peers.txt" 2>&1
  rc=$?
  tail -n 40 "$d/peers.txt"
  reason=$("$py" bench/peers/side_by_side.py --peers "$d/peers.json" --status-line 2>/dev/null)
  local floor_note="" floor_bad=0
  if [[ -s $d/peers.json ]]; then
    banner "$part: side by side and the floor check (bench/peers/side_by_side.py)"
    "$py" bench/peers/side_by_side.py --peers "$d/peers.json" "${side_args[@]}" --out "$d/side_by_side.md" \
      2>"$d/floor_check.txt"
    if [[ $? == 1 ]]; then
      floor_bad=1
      floor_note="; FLOOR CHECK FAILED: $(sed 's/^side_by_side: floor check FAILED: //' "$d/floor_check.txt" | tr '\n' ';')"
    fi
  fi
  local peers_note
  case $rc in
    0) peers_note="peers: ${reason}" ;;
    77) peers_note="no peer could run: ${reason:-see $d/peers.txt}" ;;
    2) record "$part" FAIL "$ours_note; the peers script refused its arguments (see $d/peers.txt)"; return ;;
    *) peers_note="peers ran with errors (exit $rc$( ((rc == 124 || rc == 137)) && echo ', timed out'): ${reason:-see $d/peers.txt})" ;;
  esac
  if [[ $orc != 0 || $floor_bad == 1 ]]; then
    record "$part" FAIL "$ours_note; $peers_note$floor_note"
  else
    record "$part" PASS "$ours_note; $peers_note; table $d/side_by_side.md"
  fi
}
part_forward_peers() {
  problem_peers forward-peers bench/peers/loss_forward_peers.py --iters 10 --warmup 2
}
part_target_peers() {
  problem_peers target-peers bench/peers/attention_target_peers.py --shapes "$TARGET_SHAPES" --iters 10 --warmup 2
}

part_topk_peers() {
  local d=$out/topk-peers ours=$out/topk/bench.json rc reason ours_note side_args=() peer_args=()
  mkdir -p "$d"
  [[ -n $peers_site ]] && peer_args+=(--site "$peers_site")
  if [[ -s $ours ]]; then
    ours_note="ours from $ours"; side_args+=(--ours "$ours")
  elif [[ ${run_part[topk]} == 1 ]]; then
    ours_note="ours missing (the topk part wrote no $ours)"
  else
    ours_note="ours not run (the topk part not selected)"
  fi
  banner "topk-peers: peers (bench/peers/topk_peers.py --seq $TOPK_SEQS)"
  rm -f "$d/peers.json"
  timeout -k 10 2400 "$py" bench/peers/topk_peers.py --check --seq "$TOPK_SEQS" --topk 2048 --iters 10 --warmup 2 \
    "${peer_args[@]}" --json "$d/peers.json" >"$d/peers.txt" 2>&1
  rc=$?
  tail -n 40 "$d/peers.txt"
  reason=$("$py" bench/peers/side_by_side.py --peers "$d/peers.json" --status-line 2>/dev/null)
  local floor_note="" floor_bad=0
  if [[ -s $d/peers.json ]]; then
    banner "topk-peers: side by side and the floor check (bench/peers/side_by_side.py --op topk)"
    "$py" bench/peers/side_by_side.py --peers "$d/peers.json" "${side_args[@]}" --op topk --out "$d/side_by_side.md" \
      2>"$d/floor_check.txt"
    if [[ $? == 1 ]]; then
      floor_bad=1
      floor_note="; FLOOR CHECK FAILED: $(sed 's/^side_by_side: floor check FAILED: //' "$d/floor_check.txt" | tr '\n' ';')"
    fi
  fi
  local peers_note
  case $rc in
    0) peers_note="peers: ${reason}" ;;
    77) peers_note="no peer could run: ${reason:-see $d/peers.txt}" ;;
    2) record topk-peers FAIL "$ours_note; the peers script refused its arguments (see $d/peers.txt)"; return ;;
    *) peers_note="peers ran with errors (exit $rc$( ((rc == 124 || rc == 137)) && echo ', timed out'): ${reason:-see $d/peers.txt})" ;;
  esac
  if [[ $floor_bad == 1 ]]; then
    record topk-peers FAIL "$ours_note; $peers_note$floor_note"
  else
    record topk-peers PASS "$ours_note; $peers_note; table $d/side_by_side.md"
  fi
}

# ---------------------------------------------------------------- python
part_python() {
  local d=$out/python rc
  banner "python: scripts/python_check.sh --install --cuda --require-cuda"
  bash scripts/python_check.sh --install --cuda --require-cuda "$d"
  rc=$?
  local steps
  steps=$(grep -v '^python_check:' "$d/summary.txt" 2>/dev/null | tr '\n' ';' | sed 's/;$//; s/;/; /g')
  if [[ $rc -eq 0 ]]; then
    record python PASS "$steps"
  else
    record python FAIL "exit $rc: $steps (see $d)"
  fi
}

# The package the python part installed in this run (with $py), for the parts after it.
with_python_site() {
  if [[ ${run_part[python]} == 1 && -d $out/python/site ]]; then
    PYTHONPATH="$out/python/site${PYTHONPATH:+:$PYTHONPATH}" "$@"
  else
    "$@"
  fi
}

part_torch_step() {
  local d=$out/torch-step rc
  mkdir -p "$d"
  banner "torch-step: bench/torch_step.py --check"
  with_python_site "$py" bench/torch_step.py --check --seq 16384,65536 --ids causal,random \
    --json "$d/torch_step.json" 2>&1 | tee "$d/torch_step.log"
  rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then
    record torch-step FAIL "bench/torch_step.py exit $rc (see $d/torch_step.log)"
    return
  fi
  # the same forms given the top-k's logits
  with_python_site "$py" bench/torch_step.py --check --topk-logits --seq 16384,65536 --ids causal,random \
    --json "$d/torch_step_topk_logits.json" 2>&1 | tee "$d/torch_step_topk_logits.log"
  rc=${PIPESTATUS[0]}
  if [[ $rc -eq 0 ]]; then
    record torch-step PASS "$(cat "$d/torch_step.log" "$d/torch_step_topk_logits.log" | grep -c '^\(causal\|random\) ') cases timed (see $d)"
  else
    record torch-step FAIL "bench/torch_step.py --topk-logits exit $rc (see $d/torch_step_topk_logits.log)"
  fi
}

part_megatron() {
  local d=$out/megatron rc backends=(dsaib none) b fails=() notes=()
  mkdir -p "$d"
  banner "megatron: examples/megatron_dsa_gpt.py"
  if ! with_python_site "$py" -c "import dsaib.megatron as m, sys; sys.exit(m.megatron_version() not in m.SUPPORTED_VERSIONS)" \
      >"$d/import.log" 2>&1; then
    record megatron SKIPPED "no supported megatron-core for $("$py" --version 2>&1) (see $d/import.log; PYTHON=... names another interpreter)"
    return
  fi
  local site_args=()
  [[ -n $peers_site ]] && site_args=(--site "$peers_site")
  "$py" -c "import site, sys; [sys.path.insert(0, p) or site.addsitedir(p) for p in sys.argv[1:]]; import cudnn, flash_mla" \
    ${peers_site:+"$peers_site"} >/dev/null 2>&1 && backends+=(cudnn)
  for b in "${backends[@]}"; do
    with_python_site timeout 1800 "$py" examples/megatron_dsa_gpt.py --backend "$b" --steps 300 \
      "${site_args[@]}" --csv "$d/$b.csv" >"$d/$b.log" 2>&1
    rc=$?
    if [[ $rc -ne 0 ]]; then
      [[ $b == cudnn ]] && notes+=("cudnn exit $rc") || fails+=("$b exit $rc")
    else
      notes+=("$b: $(grep -h '^backend .*mean step' "$d/$b.log" | sed 's/^backend [a-z]*: //')")
    fi
  done
  if "$py" -c "import matplotlib" >/dev/null 2>&1; then
    "$py" examples/megatron_dsa_gpt.py --plot "$d"/*.csv --png "$d/curves.png" >"$d/plot.log" 2>&1 ||
      notes+=("plot failed (see $d/plot.log)")
  else
    notes+=("no matplotlib: no plot")
  fi
  if [[ ${#fails[@]} -eq 0 ]]; then
    record megatron PASS "$(IFS=';'; echo "${notes[*]}")"
  else
    record megatron FAIL "$(IFS=';'; echo "${fails[*]}") (see $d)"
  fi
}

for p in "${ALL_PARTS[@]}"; do
  if [[ ${run_part[$p]} == 1 ]]; then
    "part_${p//-/_}"
  else
    record "$p" SKIPPED "not selected (--only / --skip-$p)"
  fi
done
finish "$failed"
