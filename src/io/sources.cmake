# safetensors reader/writer (include/dsaib/safetensors.hpp).
target_sources(dsaib PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/io/safetensors.cpp)
target_link_libraries(dsaib PRIVATE nlohmann_json::nlohmann_json)
