#!/usr/bin/env bash
# Builds the peer payload for the H200 (no internet, no package registry there):
# pinned cp312 manylinux x86_64 wheels are downloaded here, unpacked, stripped
# of what the peers do not need, and packed with xz into
#
#   .peers/cudnn.tar.xz      nvidia-cudnn-frontend + nvidia-cutlass-dsl (cu13) + apache-tvm-ffi
#   .peers/tilelang.tar.xz   tilelang + z3-solver + apache-tvm-ffi + torch-c-dlpack-ext
#   .peers/tilelang_example/ TileLang's examples/dsa_sparse_finetune/{indexer_bwd,index,utils}.py
#
# Each archive unpacks into one site folder (scripts/device/peers_check.sh uses
# /tmp/peers-site) that goes on PYTHONPATH; both archives can share that folder.
# Packages the H200 image already has (torch, numpy, ml-dtypes, psutil, tqdm,
# typing-extensions, cloudpickle, protobuf, cuda-bindings, einops) are not carried.
#
#   usage: scripts/device/pack_peers.sh [all|cudnn|tilelang] [--combined]
#     --combined   also write .peers/peers-site.tar.xz holding both (only useful
#                  if it fits the device tool's 64 MiB carry limit; it does not
#                  with these versions, see the sizes printed at the end)
#   env: PEERS_CACHE  wheel cache (default ~/.cache/dsaib-peers)
#        PEERS_PRUNE=0 keep every file of cudnn-frontend (default prunes its Python
#                      to the static import closure of the DSA indexer backward)
#        XZ_LEVEL     xz preset (default 9e)
#
# Everything under .peers/ is ignored by git. The script is reproducible: the
# versions and the sha256 of every wheel are pinned below; a mismatch stops it.
set -euo pipefail
cd "$(dirname "$0")/../.."
what=all
combined=0
for a in "$@"; do
  case $a in
    all | cudnn | tilelang) what=$a ;;
    --combined) combined=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | cut -c3-; exit 0 ;;
    *) echo "unknown argument $a" >&2; exit 2 ;;
  esac
done
cache=${PEERS_CACHE:-$HOME/.cache/dsaib-peers}
prune=${PEERS_PRUNE:-1}
xz_level=${XZ_LEVEL:-9e}
out=.peers
mkdir -p "$cache/wheels" "$out"
py=${PYTHON:-python3}

# sha256 of each pinned wheel (the cp312 manylinux x86_64 file pip picks)
read -r -d '' SHAS <<'EOF' || true
apache_tvm_ffi-0.1.12-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl dc0acd7eeb0e451d5e3f686af3ba0b495fdbf97b5b54cf9a0f770cdafe0e691a
nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl 8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239
nvidia_cutlass_dsl-4.8.1-py3-none-any.whl 43ed46b21d151aa643c6765457c7310827b938c1cf45d5109a0152de4ef06227
nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl ac2fd8c7fa3d6ded00917fa7cba8686061005da8c4703c6a29e03c1504543909
nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl bacc6760e3286db447d45720d32ae58ac2e6cecade1152345ef784b2d5e44431
nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl 50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90
tilelang-0.1.15-cp39-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl ca021a3450ad84b8fe7deb1b659c8d3d2e4b0855fdb59e2992a5349acf019881
torch_c_dlpack_ext-0.1.5-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl e6f9da4bb9af70e27facc777458be62e10dbbbddda7672d16138db0553c5a524
z3_solver-4.15.4.0-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl 7e103a6f203f505b8b8b8e5c931cc407c95b61556512d4921c1ddc0b3f41b08e
EOF

platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64)

wheel_of() { # name==version -> path of the cached wheel (downloads it if missing)
  local spec=$1 name ver norm f
  name=${spec%%==*}
  ver=${spec##*==}
  norm=$(echo "$name" | tr '-' '_')
  f=$(ls "$cache/wheels/${norm}-${ver}-"*.whl 2>/dev/null | head -1 || true)
  if [[ -z $f ]]; then
    echo "  downloading $spec" >&2
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$cache/wheels" "$spec" >&2
    f=$(ls "$cache/wheels/${norm}-${ver}-"*.whl | head -1)
  fi
  local want got
  want=$(awk -v w="$(basename "$f")" '$1 == w {print $2}' <<<"$SHAS")
  got=$(sha256sum "$f" | cut -d' ' -f1)
  if [[ -n $want && $want != "$got" ]]; then
    echo "sha256 mismatch for $(basename "$f"): got $got, pinned $want" >&2
    exit 1
  fi
  [[ -z $want ]] && echo "  (no pinned sha256 for $(basename "$f"): $got)" >&2
  echo "$f"
}

unpack() { # wheel stage
  "$py" - "$1" "$2" <<'EOF'
import sys, zipfile, os
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
EOF
}

common_strip() { # stage: things no peer needs at run time
  local s=$1
  find "$s" -name '__pycache__' -type d -prune -exec rm -rf {} +
  find "$s" -name '*.pyc' -delete
  find "$s" -path '*.dist-info/RECORD' -delete
  # apache-tvm-ffi: the libbacktrace sources (its core.abi3.so needs lib/libtvm_ffi_testing.so: kept)
  rm -rf "$s/tvm_ffi/3rdparty/libbacktrace"
}

pack() { # stage archive
  local s=$1 archive=$2
  echo "  packing $(du -sh "$s" | cut -f1) into $archive (xz -$xz_level --x86, this takes minutes)"
  # BCJ x86 filter first: the payload is mostly x86-64 shared libraries.
  tar -C "$s" --owner=0 --group=0 --numeric-owner --sort=name -cf - . |
    xz --x86 --lzma2=preset="$xz_level" -T0 -c >"$archive.tmp"
  mv "$archive.tmp" "$archive"
}

build_cudnn() {
  echo "== cudnn-frontend payload"
  local s=$cache/stage-cudnn
  rm -rf "$s" && mkdir -p "$s"
  for spec in nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.12; do
    unpack "$(wheel_of "$spec")" "$s"
  done
  common_strip "$s"
  # cudnn-frontend: C++ headers, and (by default) every module the DSA indexer
  # backward cannot import; cutlass-dsl: the separate iket profiler package,
  # the aarch64/QNX stubs, static library and C header.
  rm -rf "$s/include" "$s/nvidia_cutlass_dsl/dsl_packages/iket" "$s/nvidia_cutlass_dsl/cu13/lib/stubs" \
    "$s/nvidia_cutlass_dsl/cu13/include"
  find "$s/nvidia_cutlass_dsl" -name '*.a' -delete
  if [[ $prune == 1 ]]; then
    "$py" - "$s" <<'EOF'
"""Keep cudnn/*.py at the top level, all of deepseek_sparse_attention, and the static
import closure (AST: every import statement, also those inside functions) of
cudnn.deepseek_sparse_attention.indexer_backward; delete the other cudnn files."""
import ast, os, sys
site = sys.argv[1]
root = os.path.join(site, "cudnn")

def resolve(mod):
    p = os.path.join(site, *mod.split("."))
    if os.path.isfile(p + "/__init__.py"):
        return p + "/__init__.py"
    if os.path.isfile(p + ".py"):
        return p + ".py"
    return None

keep, seen, todo = set(), set(), ["cudnn.deepseek_sparse_attention.indexer_backward"]
while todo:
    mod = todo.pop()
    if mod in seen:
        continue
    seen.add(mod)
    parts = mod.split(".")
    todo += [".".join(parts[:i]) for i in range(1, len(parts))]
    f = resolve(mod)
    if f is None:
        continue
    keep.add(f)
    pkg = mod if f.endswith("__init__.py") else ".".join(parts[:-1])
    for node in ast.walk(ast.parse(open(f, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            todo += [a.name for a in node.names if a.name.split(".")[0] == "cudnn"]
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            if name.split(".")[0] == "cudnn":
                todo += [name] + [name + "." + a.name for a in node.names if a.name != "*"]
removed = kept = 0
for d, _, files in os.walk(root):
    for fn in files:
        p = os.path.join(d, fn)
        rel = os.path.relpath(p, root)
        top_level = os.sep not in rel
        dsa = rel.startswith("deepseek_sparse_attention" + os.sep)
        if top_level or dsa or p in keep:
            kept += 1
        else:
            os.remove(p)
            removed += 1
for d, dirs, files in os.walk(root, topdown=False):
    if not os.listdir(d):
        os.rmdir(d)
print(f"  cudnn python: kept {kept} files, removed {removed}")
EOF
  fi
  pack "$s" "$out/cudnn.tar.xz"
}

build_tilelang() {
  echo "== tilelang payload"
  local s=$cache/stage-tilelang
  rm -rf "$s" && mkdir -p "$s"
  for spec in tilelang==0.1.15 z3-solver==4.15.4.0 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5; do
    unpack "$(wheel_of "$spec")" "$s"
  done
  common_strip "$s"
  local t=$s/tilelang
  # C++ sources of the compiler (the JIT needs only src/tl_templates), TVM's C++
  # sources, CUTLASS's tools (the kernels include cutlass/include only).
  find "$t/src" -mindepth 1 -maxdepth 1 ! -name tl_templates -exec rm -rf {} +
  rm -rf "$t/3rdparty/tvm/src" "$t/3rdparty/cutlass/tools"
  # z3-solver: the z3 binary, headers, and the second copy of libz3 (a link instead)
  rm -rf "$s"/z3_solver-*.data "$s/z3/include"
  if [[ -f $s/z3/lib/libz3.so.4.15 ]]; then
    rm -f "$s/z3/lib/libz3.so" && ln -s libz3.so.4.15 "$s/z3/lib/libz3.so"
  fi
  pack "$s" "$out/tilelang.tar.xz"
}

example_sha=0d517cb6a301a68a6a5125ab65e506a39943270cbdc9592a34e539ad82fea33d
check_example() {
  local d=$out/tilelang_example missing=0
  for f in indexer_bwd.py index.py utils.py; do
    [[ -f $d/$f ]] || { echo "  MISSING: $d/$f" >&2; missing=1; }
  done
  if [[ $missing == 1 ]]; then
    cat >&2 <<EOF
  The TileLang example is not committed to this repo (licence and hygiene). Put
  tile-ai/tilelang's examples/dsa_sparse_finetune/indexer_bwd.py, index.py and
  utils.py (MIT) into $d/ unchanged: from a clone of github.com/tile-ai/tilelang
  where one is reachable, or, on these machines (no GitHub), from the search
  tool's read_file (repo tile-ai/tilelang; indexer_bwd.py at commit
  32ac58df55a51410ee3c6fad4dc063b4007ed6e3 was used first; expected sha256 below).
  Without it the tilelang peer reports itself unavailable.
EOF
  fi
  echo "  tilelang example: indexer_bwd.py sha256 $(sha256sum "$d/indexer_bwd.py" 2>/dev/null | cut -d' ' -f1)" \
    "(commit 32ac58df: $example_sha)"
}

[[ $what == all || $what == cudnn ]] && build_cudnn
[[ $what == all || $what == tilelang ]] && build_tilelang
[[ $what == all || $what == tilelang ]] && check_example
if [[ $combined == 1 ]]; then
  echo "== combined payload"
  s=$cache/stage-combined
  rm -rf "$s" && mkdir -p "$s"
  for a in cudnn tilelang; do tar -C "$s" -xJf "$out/$a.tar.xz"; done
  pack "$s" "$out/peers-site.tar.xz"
fi

set +e +o pipefail # sizes are informational: never fail here
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
bytes() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
echo "== sizes (the device tool carries at most 64 MiB in all: working tree + carried paths)"
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
base=$((${tree:-0} + ${untracked:-0}))
bench=$(bytes .device/bin/dsa-indexer-bwd-bench .device/bin/dsa-floor-bench)
dev=$(bytes .device)
ex=$(bytes "$out/tilelang_example")
echo "  working tree (tracked + untracked, not ignored): $(mib "$base")"
echo "  .device: $(mib "${dev:-0}") (the two bench binaries alone: $(mib "${bench:-0}"))"
echo "  .peers/tilelang_example: $(mib "${ex:-0}")"
for f in "$out"/*.tar.xz; do
  [[ -f $f ]] || continue
  sz=$(stat -c %s "$f")
  extra=0
  [[ $f != *cudnn* ]] && extra=${ex:-0}
  echo "  $f: $(mib "$sz");  with the tree and all of .device: $(mib $((base + ${dev:-0} + sz + extra)))"
done
