# safetensors reader/writer (include/dsaib/safetensors.hpp).
target_sources(dsaib PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/io/safetensors.cpp ${CMAKE_CURRENT_SOURCE_DIR}/io/safetensors_header.cpp)
# Header-only and private: the build interface keeps it out of the exported target.
target_link_libraries(dsaib PRIVATE $<BUILD_INTERFACE:nlohmann_json::nlohmann_json>)
