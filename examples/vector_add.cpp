// The tutorial's vector_add (section 3.2) as a kload op library: the same
// operation (a + b), registered with the dispatcher instead of pybind11, and
// compiled against <kload/kernel.h> instead of <torch/extension.h>.
#include <kload/kernel.h>

at::Tensor vector_add(const at::Tensor& a, const at::Tensor& b) {
  // 输入检查
  CHECK_INPUT(a);
  CHECK_INPUT(b);
  // 执行加法运算
  return a.add(b);
}

KLOAD_LIBRARY(m) { m.def("vector_add(Tensor a, Tensor b) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("vector_add", &vector_add); }
