# Install rules and the exported CMake package.
#   cmake --install build --prefix P
# installs the static library, the public headers (include/dsaib), the CLI and
# P/lib*/cmake/dsaib/{dsaibConfig,dsaibConfigVersion,dsaibTargets}.cmake, so that
# a consumer writes
#   find_package(dsaib 0.1 CONFIG REQUIRED)   # CMAKE_PREFIX_PATH=P
#   target_link_libraries(app PRIVATE dsaib::dsaib)
# (dsaib::dsaib is also the name under add_subdirectory). Components: `dev`
# (library, headers, package files) and `cli`. pip's wheel build installs only
# its `python` component and does not include this file; a parent project that
# adds this one with add_subdirectory gets these rules only with DSAIB_INSTALL=ON.
# Checked by the ctest install_and_consume (tests/install_consumer/).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(dsaib_package_dir ${CMAKE_INSTALL_LIBDIR}/cmake/dsaib)

install(TARGETS dsaib EXPORT dsaibTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT dev)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dsaib DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
install(EXPORT dsaibTargets NAMESPACE dsaib:: DESTINATION ${dsaib_package_dir} COMPONENT dev)

# dsaibConfig.cmake finds what the exported target links (Threads; CUDAToolkit for
# CUDA::cudart when the cuda backend is compiled in) and sets dsaib_WITH_CUDA.
set(DSAIB_PACKAGE_WITH_CUDA ${DSAIB_ENABLE_CUDA})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dsaibConfig.cmake.in
  ${PROJECT_BINARY_DIR}/dsaibConfig.cmake INSTALL_DESTINATION ${dsaib_package_dir})
# 0.x: a minor version may change the API and the C ABI (include/dsaib/dsaib.h).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dsaibConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dsaibConfig.cmake ${PROJECT_BINARY_DIR}/dsaibConfigVersion.cmake
  DESTINATION ${dsaib_package_dir} COMPONENT dev)
