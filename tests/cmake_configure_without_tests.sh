#!/bin/sh
# ctest cmake_configure_without_tests: the project configures with
# DSAIB_BUILD_TESTS=OFF, as pip's wheel build does (pyproject.toml), with the
# cuda backend as in this build. A test-only CMake command outside the
# DSAIB_BUILD_TESTS guard fails here (bench/'s gtest_discover_tests, which
# needs include(GoogleTest), once broke `pip install . -C
# cmake.define.DSAIB_ENABLE_CUDA=ON` unnoticed, as CI builds the CPU wheel).
# python/ (configured only under pip's SKBUILD, with nanobind) is not covered.
#   usage: cmake_configure_without_tests.sh CMAKE SOURCE_DIR [cmake options...]
#   (CMAKE: the cmake that configured this build, ctest passes ${CMAKE_COMMAND})
cmake=$1
src=$2
shift 2
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
trap 'rm -rf "$dir"; exit 1' INT TERM  # ctest's timeout sends TERM
if ! out=$("$cmake" -S "$src" -B "$dir" -DDSAIB_BUILD_TESTS=OFF "$@" 2>&1); then
  echo "$out"
  echo "cmake_configure_without_tests: FAIL: the configure with DSAIB_BUILD_TESTS=OFF failed (above)"
  exit 1
fi
if echo "$out" | grep -q "CMake Error"; then
  echo "$out"
  echo "cmake_configure_without_tests: FAIL: CMake errors (above)"
  exit 1
fi
grep -q "^DSAIB_ENABLE_CUDA:BOOL=" "$dir/CMakeCache.txt" || { echo "cmake_configure_without_tests: FAIL: no cache written"; exit 1; }
echo "cmake_configure_without_tests: configured with DSAIB_BUILD_TESTS=OFF ($(grep '^DSAIB_ENABLE_CUDA:BOOL=' "$dir/CMakeCache.txt"))"
