// kload's <torch/extension.h> for CUDA sources that need none of its Python half.
//
// torch's own header is <torch/all.h> (the whole C++ frontend: nn, optim, data,
// jit, ...) plus <torch/python.h> (Python.h and pybind11). A .cu whose bindings live
// in a .cpp, as the tutorial writes it, uses neither, yet nvcc parses them three
// times per architecture (host preprocessing, cudafe++, cicc): nvcc has no
// precompiled headers. kload puts this file's directory first on nvcc's include
// path for such sources (sources.py decides: no PYBIND11_MODULE, no pybind11 and
// no torch:: frontend namespace in any .cu; KLOAD_LEAN_CUDA=0 turns it off).
//
// What a kernel's launcher uses is all here: torch::Tensor, the factories
// (torch::empty_like, torch::zeros, ...), TORCH_CHECK, ATen (at::), AT_DISPATCH_*.
#pragma once

#include <torch/types.h>
