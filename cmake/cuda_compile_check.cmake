# GPU sources must at least compile on CPU-only machines (DESIGN.md section 1). Debian's LibTorch
# ships the c10/cuda and ATen/cuda headers but not the generated cuda_cmake_macros.h; the shim in
# cmake/cuda_shim provides it, and the CUDA toolkit provides cuda_runtime.h and nccl.h. The object
# library below is built (so CI fails when a GPU source breaks) but linked into nothing.
find_path(NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include ENV CUDA_HOME PATH_SUFFIXES include)
if(MFSDP_COMPILE_CHECK_CUDA STREQUAL "AUTO")
  if(NCCL_INCLUDE_DIR)
    set(_check ON)
  else()
    set(_check OFF)
    message(STATUS "mfsdp: nccl.h not found; GPU sources are not compile-checked")
  endif()
else()
  set(_check ${MFSDP_COMPILE_CHECK_CUDA})
endif()
if(_check)
  if(NOT NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "MFSDP_COMPILE_CHECK_CUDA=ON but nccl.h was not found (set CUDA_HOME)")
  endif()
  add_library(mfsdp_cuda_compile_check OBJECT src/comm/nccl_communicator.cpp)
  target_include_directories(mfsdp_cuda_compile_check PRIVATE
    include src ${CMAKE_CURRENT_LIST_DIR}/cuda_shim ${NCCL_INCLUDE_DIR})
  target_compile_definitions(mfsdp_cuda_compile_check PRIVATE MFSDP_WITH_CUDA=1)
  target_link_libraries(mfsdp_cuda_compile_check PRIVATE ${TORCH_LIBRARIES})
  target_compile_options(mfsdp_cuda_compile_check PRIVATE -Wall -Wextra -Wno-unused-parameter)
endif()
