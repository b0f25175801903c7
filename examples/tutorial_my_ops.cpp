// The tutorial's section 3.2 (../shared/seeds/), as a user pastes it, with the
// punctuation that extraction lost restored (<>, "", &, +). CHECK_INPUT is used
// without being defined, exactly as the tutorial writes it.
#include <torch/extension.h>

torch::Tensor vector_add(torch::Tensor a, torch::Tensor b) {
    // 输入检查
    CHECK_INPUT(a);
    CHECK_INPUT(b);

    // 执行加法运算
    return a + b;
}

// 绑定到Python模块
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("vector_add", &vector_add, "Vector addition");
}
