// Shim for Debian's CPU LibTorch: its c10/cuda headers are shipped but this generated header is
// not. Only used to *compile* the GPU sources in CI (MFSDP_COMPILE_CHECK_CUDA); a real CUDA build
// uses the header of the CUDA LibTorch.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
