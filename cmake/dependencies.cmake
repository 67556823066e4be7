# Third-party dependencies, each from a maintained package:
#   GoogleTest (Debian libgtest-dev), CLI11 (libcli11-dev), nlohmann-json (nlohmann-json3-dev),
#   CUTLASS/CuTe headers from the pinned PyPI wheel nvidia-cutlass==4.2.0.0 (cuda backend only).
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 CONFIG QUIET)
if(NOT CLI11_FOUND)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE ${CLI11_INCLUDE_DIR})
endif()
if(DSAIB_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

set(DSAIB_CUTLASS_VERSION "4.2.0.0")
if(DSAIB_ENABLE_CUDA)
  set(DSAIB_CUTLASS_INCLUDE_DIR "" CACHE PATH "CUTLASS include dir (default: from the nvidia-cutlass wheel)")
  if(NOT DSAIB_CUTLASS_INCLUDE_DIR)
    find_package(Python3 COMPONENTS Interpreter REQUIRED)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
        "import importlib.metadata as m, os, cutlass_library as c; print(m.version('nvidia-cutlass')); print(os.path.join(os.path.dirname(c.__file__), 'source', 'include'))"
      OUTPUT_VARIABLE _cutlass_out RESULT_VARIABLE _cutlass_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT _cutlass_rc EQUAL 0)
      message(FATAL_ERROR "CUTLASS headers not found: pip install nvidia-cutlass==${DSAIB_CUTLASS_VERSION}, or set DSAIB_CUTLASS_INCLUDE_DIR")
    endif()
    string(REPLACE "\n" ";" _cutlass_lines "${_cutlass_out}")
    list(GET _cutlass_lines 0 _cutlass_ver)
    list(GET _cutlass_lines 1 _cutlass_inc)
    if(NOT _cutlass_ver STREQUAL DSAIB_CUTLASS_VERSION)
      message(FATAL_ERROR "nvidia-cutlass ${_cutlass_ver} found, ${DSAIB_CUTLASS_VERSION} pinned")
    endif()
    set(DSAIB_CUTLASS_INCLUDE_DIR "${_cutlass_inc}" CACHE PATH "" FORCE)
  endif()
  if(NOT EXISTS "${DSAIB_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
    message(FATAL_ERROR "no cute/tensor.hpp under DSAIB_CUTLASS_INCLUDE_DIR=${DSAIB_CUTLASS_INCLUDE_DIR}")
  endif()
  message(STATUS "CUTLASS headers: ${DSAIB_CUTLASS_INCLUDE_DIR}")
  # sm_90a device code; ptxas warnings (spills, local memory, ignored setmaxnreg) fail the build.
  set(DSAIB_CUDA_FLAGS
    -gencode arch=compute_90a,code=sm_90a
    --expt-relaxed-constexpr
    -Xptxas=-v,-warn-spills,-warn-lmem-usage,-Werror
    -lineinfo)
endif()
