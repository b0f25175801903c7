// conv2d/conv2d_geometry.h — a convolution's sizes, shared by conv2d.cpp (g++) and
// conv2d.cu (nvcc, which includes no torch header): plain data, passed by value
// to the CUDA kernels.
#pragma once

#include <cstdint>

namespace kload_conv2d {

struct Geometry {
  int64_t N, C, H, W, OC, KH, KW, SH, SW, PH, PW, OH, OW;
  int64_t ckk() const { return C * KH * KW; }
  int64_t ohw() const { return OH * OW; }
};

}  // namespace kload_conv2d
