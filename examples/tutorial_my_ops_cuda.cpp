// The bindings for the tutorial's section 4.1 .cu (tutorial_my_ops_cuda.cu), in
// the tutorial's section 3.2 style: PYBIND11_MODULE in the .cpp, CHECK_INPUT used
// without being defined. Load both: kload.load("tutorial_my_ops_cuda.cpp",
// "tutorial_my_ops_cuda.cu"); with CUDA tensors the .cu's kernel runs.
#include <torch/extension.h>

torch::Tensor vector_add_cuda(torch::Tensor a, torch::Tensor b);

torch::Tensor vector_add(torch::Tensor a, torch::Tensor b) {
    CHECK_INPUT(a);
    CHECK_INPUT(b);
    TORCH_CHECK(a.sizes() == b.sizes(), "vector_add: a and b must have the same shape, got ", a.sizes(), " and ",
                b.sizes());
    TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32,
                "vector_add: a and b must be float32, got ", a.scalar_type(), " and ", b.scalar_type());
    TORCH_CHECK(a.device() == b.device(), "vector_add: a and b must be on the same device, got ", a.device(),
                " and ", b.device());
    if (!a.is_cuda()) return a + b;
    // the tutorial's launch shape works up to 262144 elements (see the .cu)
    TORCH_CHECK(a.numel() <= 256 * 1024, "vector_add: the tutorial's launch covers at most 262144 elements, got ",
                a.numel());
    return vector_add_cuda(a, b);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("vector_add", &vector_add, "Vector addition");
}
