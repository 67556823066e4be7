target_sources(dsaib PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/generate/generate.cpp ${CMAKE_CURRENT_SOURCE_DIR}/generate/sequences.cpp)
