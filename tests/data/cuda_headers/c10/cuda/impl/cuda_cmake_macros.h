// The one header a CUDA build of torch generates that the CPU wheel lacks (its
// content in CUDA wheels is this define). Only the compile-only nvcc test uses it.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
