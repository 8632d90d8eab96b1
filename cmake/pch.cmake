# One precompiled header for the LibTorch includes, shared by every target (REUSE_FROM), so each
# translation unit skips the ~8 s parse of <torch/torch.h> (measured on the 2-core VM: 10 s per
# Release TU without it, under 5 s with it).
add_library(mfsdp_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch_anchor.cpp)
target_link_libraries(mfsdp_pch PRIVATE ${TORCH_LIBRARIES})
target_compile_options(mfsdp_pch PRIVATE -Wall -Wextra -Wno-unused-parameter)
set(MFSDP_PCH_HEADERS
  <torch/torch.h>
  <torch/csrc/distributed/c10d/TCPStore.hpp>
  <vector> <string> <memory> <functional> <chrono> <mutex> <condition_variable> <thread>)
target_precompile_headers(mfsdp_pch PRIVATE ${MFSDP_PCH_HEADERS})

function(mfsdp_use_pch target)
  target_precompile_headers(${target} REUSE_FROM mfsdp_pch)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
endfunction()
