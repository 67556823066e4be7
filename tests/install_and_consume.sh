#!/bin/sh
# ctest install_and_consume: `cmake --install` of this build into a temporary
# prefix, then a separate project (tests/install_consumer/) that finds it with
# find_package(dsaib CONFIG) alone, links dsaib::dsaib from C++ and from C, and
# runs both programs (cpu backend: results against fp64, one argument error
# each). Also runs the installed CLI's --help. Fails on any step.
#   usage: install_and_consume.sh CMAKE BUILD_DIR SOURCE_DIR [consumer configure options...]
# DSAIB_CONSUMER_KEEP=DIR copies the two consumer programs there (to run them on
# another machine, e.g. one with a GPU).
cmake=$1
build=$2
src=$3
shift 3
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
trap 'rm -rf "$dir"; exit 1' INT TERM  # ctest's timeout sends TERM
fail() { echo "install_and_consume: FAIL: $*"; exit 1; }
"$cmake" --install "$build" --prefix "$dir/prefix" > "$dir/install.log" 2>&1 || { cat "$dir/install.log"; fail "cmake --install"; }
pkg=$(find "$dir/prefix" -name dsaibConfig.cmake) || true
[ -n "$pkg" ] || fail "no dsaibConfig.cmake under the prefix"
[ -f "$dir/prefix/include/dsaib/indexer_backward.hpp" ] || fail "no include/dsaib/indexer_backward.hpp under the prefix"
[ -f "$dir/prefix/include/dsaib/dsaib.h" ] || fail "no include/dsaib/dsaib.h under the prefix"
echo "install_and_consume: installed $(find "$dir/prefix" -type f | wc -l) files; package: ${pkg#$dir/prefix/}"
"$dir/prefix/bin/dsaib" --help > "$dir/cli_help.txt" 2>&1 || { cat "$dir/cli_help.txt"; fail "installed dsaib --help"; }
"$cmake" -S "$src/tests/install_consumer" -B "$dir/consumer" -DCMAKE_PREFIX_PATH="$dir/prefix" \
  -DCMAKE_BUILD_TYPE=Release "$@" > "$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; fail "consumer configure"; }
grep "dsaib_WITH_CUDA" "$dir/configure.log"
"$cmake" --build "$dir/consumer" > "$dir/build.log" 2>&1 || { cat "$dir/build.log"; fail "consumer build"; }
"$dir/consumer/consumer_cxx" || fail "consumer_cxx"
"$dir/consumer/consumer_c" || fail "consumer_c"
if [ -n "${DSAIB_CONSUMER_KEEP:-}" ]; then
  mkdir -p "$DSAIB_CONSUMER_KEEP" && cp "$dir/consumer/consumer_cxx" "$dir/consumer/consumer_c" "$DSAIB_CONSUMER_KEEP/" ||
    fail "copying the consumers to DSAIB_CONSUMER_KEEP=$DSAIB_CONSUMER_KEEP"
fi
echo "install_and_consume: PASS"
