"""A .cu with torch's headers compiled in two halves (split_build.py): the host code by
g++ with its #include block precompiled, the kernels by nvcc without torch's host headers.

The text tests read cusplit.py's output; the build tests compile for real under a CUDA
build of torch (`make upgrade-check` runs this file in its venv; no GPU: what they check
is what the compilers, the linker and the loader see). They share one cache, so each
#include block is precompiled once for the module, and build for one architecture.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

import kload
from kload.compile.cuda_split import scan as cuscan, split as cusplit
from kload.cache.store import Store
from kload.options import make_options
from kload.plan.plan import make_plan
from kload.compile.cuda_split.build import SplitBuild

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
needs_cuda = pytest.mark.skipif(torch.version.cuda is None or shutil.which("nvcc") is None,
                                reason="needs a CUDA build of torch and nvcc (make upgrade-check)")


# -- the text: what each half gets --------------------------------------------------------

def halves(src: str, path: str = "/w/k.cu") -> cusplit.Split:
    return cusplit.split(textwrap.dedent(src), path)


def test_the_tutorials_halves():
    text = (EXAMPLES / "tutorial_my_ops_cuda.cu").read_text()
    sp = cusplit.split(text, "/w/t.cu")
    assert sp.prefix == "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>\n"
    assert "void vector_add_kernel(const float* a, const float* b, float* out, int64_t n);" in sp.host
    assert "__cudaPushCallConfiguration(blocks, threads) ? (void)0 : vector_add_kernel(" in sp.host
    assert "threadIdx" not in sp.host and "torch::" not in sp.device and "#include <torch" not in sp.device
    assert sp.device.startswith("#include <kload/split/device.h>\n")
    assert "out[i] = a[i] + b[i];" in sp.device
    # every piece says where it came from: errors name the user's file and line
    kernel_line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith("__global__"))
    assert f'#line {kernel_line} "/w/t.cu"\n__global__ void vector_add_kernel' in sp.device
    assert sp.kernels == ("vector_add_kernel",) and sp.templates == ()


def test_launches_are_written_as_nvcc_writes_them_for_the_host_compiler():
    src = """\
        void f(float* x, cudaStream_t s) {
          ns::k<float, 4><<<dim3(2, 3), 256, 16 * sizeof(float), s>>>(
              x,
              n);
          (table[i])<<<1, 1>>>(x);
          auto go = [&] { g<<<grid(n), 32>>>(x, std::min<int>(n, 4)); };
        }
        """
    code, _ = cuscan.mask(src)
    out = cusplit.rewrite_launches(src, code)
    assert "(__cudaPushCallConfiguration(dim3(2, 3), 256, 16 * sizeof(float), s) ? (void)0 : ns::k<float, 4>(" in out
    assert "(__cudaPushCallConfiguration(1, 1) ? (void)0 : (table[i])(x))" in out
    assert "(__cudaPushCallConfiguration(grid(n), 32) ? (void)0 : g(x, std::min<int>(n, 4)))" in out
    assert "<<<" not in out and out.count("\n") == src.count("\n")  # lines stay where they were


def test_comments_strings_and_raw_strings_hide_braces_and_launches():
    sp = halves("""\
        #include <torch/extension.h>
        const char* doc = R"x(a } and k<<<1, 1>>>() in a raw string)x";  // and } here
        /* a { in a comment */ constexpr long kBig = 1'000'000;
        __global__ void k(char* p) { p[0] = '}'; p[1] = "{"[0]; }
        void go(char* p) { k<<<1, 1>>>(p); }
        """)
    assert sp.kernels == ("k",)
    assert "constexpr long kBig" not in sp.device  # no kernel names it
    assert 'R"x(a } and k<<<1, 1>>>() in a raw string)x"' in sp.host  # literals are not rewritten


def test_template_kernels_and_what_the_device_half_takes_along():
    sp = halves("""\
        #include <torch/extension.h>
        #define HD __host__ __device__
        constexpr int kBlock = 128;
        struct Pair { float a, b; __device__ float sum() const { return a + b; } };
        HD inline float twice(float v) { return 2 * v; }
        __constant__ float kScale[4];
        namespace {
        template <typename scalar_t>
        __global__ void __launch_bounds__(kBlock) rows(const scalar_t* x, scalar_t* y, Pair p) {
          y[threadIdx.x] = x[threadIdx.x] * kScale[0] * twice(p.sum());
        }
        }  // namespace
        torch::Tensor host_only(torch::Tensor t) { return t; }
        void launch(const float* x, float* y) {
          cudaMemcpyToSymbol(kScale, x, 16);
          rows<float><<<1, kBlock>>>(x, y, Pair{1, 2});
        }
        """)
    [name] = sp.templates
    assert re.fullmatch(r"kload_anon_[0-9a-f]{8}::rows", name)  # the unnamed namespace, named alike in both
    for kept in ("constexpr int kBlock", "struct Pair", "HD inline float twice", "__constant__ float kScale"):
        assert kept in sp.device, kept
    assert "host_only" not in sp.device and "threadIdx" not in sp.host
    # the host half: Pair's __device__ member reduced to a declaration, kScale reached by reference
    assert "__device__ float sum() const ;" in sp.host
    assert re.search(r'extern decltype\(kload_decl_kScale\)& kScale __asm__\("kload_ref_\w+_kScale"\);', sp.host)
    assert re.search(r'decltype\(kScale\)& kload_ref_\w+_kScale __asm__\("kload_ref_\w+_kScale"\) = kScale;',
                     sp.device)
    inst = cusplit.instantiations(sp, [f"void {name}<c10::Half>(c10::Half const*, c10::Half*, Pair)", "free"])
    assert "#include <c10/util/Half.h>" in inst and f"= &{name}<c10::Half>;" in inst


@pytest.mark.parametrize("src, why", [
    ("void f() { auto g = [] __device__ (int i) { return i; }; }", "host code uses __device__"),
    ("#define GO(k) k<<<1, 1>>>()\n", "a macro holds a kernel launch"),
    ("#ifdef __CUDACC__\nint x;\n#endif\n", "reads __CUDACC__"),
    ("void f(int* p) { thrust::fill(p, p + 4, 0); }", "host code uses thrust"),
    ("__global__ void k() { child<<<1, 1>>>(); }", "dynamic parallelism"),
    ("void f() { {", "unbalanced"),
])
def test_text_that_cannot_be_split_says_why(src, why):
    with pytest.raises(cusplit.NotSplit, match=why):
        halves("#include <torch/extension.h>\n" + src)


def test_a_cu_without_torchs_host_headers_is_left_whole():
    with pytest.raises(cusplit.NotSplit, match="none of torch's host headers"):
        halves("#include <cuda_runtime.h>\n__global__ void k() {}\n")


# -- the build: real compiles ------------------------------------------------------------

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: each #include block is precompiled once (~15 s)."""
    root = tmp_path_factory.mktemp("split-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("KLOAD_CACHE_DIR", str(root))
    mp.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    mp.setenv("KLOAD_PCH", "1")
    mp.delenv("KLOAD_SPLIT_CUDA", raising=False)
    yield root
    mp.undo()


def build(*paths: Path):
    p = kload.load(*paths, reload=False).build()
    return p, p.entry.manifest["cuda_split"]


def fatbin_kernels(so: str) -> set[str]:
    """The mangled names of the kernels in a library's device code (its .nv_fatbin)."""
    out = Path(so).with_suffix(".fatbin")
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", so, str(out)], check=True)
    return set(re.findall(rb"\.text\.(_Z[\w]+)", out.read_bytes()))


@needs_cuda
def test_an_edit_of_either_half_recompiles_that_half_only(cache, tmp_path):
    """The op-library style (examples/vector_add_cuda.cu: kernel.h, a template kernel
    through AT_DISPATCH over four dtypes): cold, the #include block is precompiled; an edit
    of the kernel recompiles the device half alone, one of the launcher the host half alone.
    Every kernel the host half launches is in the library's device code, under its name."""
    cpp, cu = tmp_path / "vector_add.cpp", tmp_path / "vector_add_cuda.cu"
    shutil.copy(EXAMPLES / "vector_add.cpp", cpp)
    shutil.copy(EXAMPLES / "vector_add_cuda.cu", cu)
    art, note = build(cpp, cu)
    assert art.how == "built" and note[str(cu)].startswith("split: precompiled its #include block"), note
    assert "precompiled #include block used" in note[str(cu)]
    host_obj = next((art.build_dir / "split").glob("vector_add_cuda-*.host.o"))
    launched = {s for s in subprocess.run(["nm", "--undefined-only", str(host_obj)], capture_output=True,
                                          text=True).stdout.split() if "vector_add_kernel" in s}
    assert len(launched) == 4 and {s.encode() for s in launched} <= fatbin_kernels(str(art)), launched
    # what `kload ide` hands clangd: the .cu as nvcc compiles it whole, not the halves or a placeholder
    db = {e["file"]: e["command"] for e in json.loads((art.build_dir / "compile_commands.json").read_text())}
    assert {str(cpp), str(cu)} <= set(db) and not any(f.endswith("_kload_split_.cpp") for f in db), db
    assert "nvcc" in db[str(cu)] and "-gencode" in db[str(cu)], db[str(cu)]

    cu.write_text(cu.read_text().replace("out[i] = a[i] + b[i];", "out[i] = a[i] + b[i] + scalar_t(0);"))
    art, note = build(cpp, cu)
    assert re.fullmatch(r"split: device half [\d.]+ s", note[str(cu)]), note

    # a header of the user's beside the .cu, included by both halves (found from build_dir/split) and in the key
    (tmp_path / "va_zero.h").write_text("#define VA_ZERO 0\n")
    cu.write_text(cu.read_text().replace("+ scalar_t(0);", "+ scalar_t(VA_ZERO);")
                  .replace("// --- kernel -", '#include "va_zero.h"\n// --- kernel -'))
    art, note = build(cpp, cu)
    assert note[str(cu)].startswith("split: "), note
    assert str(tmp_path / "va_zero.h") in art.entry.manifest["headers"]
    (tmp_path / "va_zero.h").write_text("#define VA_ZERO 1 - 1\n")  # that header edited alone: a new build
    again, note = build(cpp, cu)
    assert again.entry.key != art.entry.key and note[str(cu)].startswith("split: "), note

    cu.write_text(cu.read_text().replace("if (n == 0) return out;", "if (n <= 0) return out;"))
    art, note = build(cpp, cu)
    assert re.fullmatch(r"split: host half [\d.]+ s, precompiled #include block used", note[str(cu)]), note
    h = kload.load(cpp, cu, reload=False)
    x = torch.arange(4.0)
    assert torch.equal(h.vector_add(x, x), 2 * x)  # the CPU kernel; the CUDA one is the host half's
    qual = f"{h.namespace}::vector_add"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA")
    with pytest.raises(RuntimeError, match="cuda|CUDA"):  # the host half runs: its device guard refuses a CPU tensor
        h.vector_add.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), x, x)

    # a mistake in the kernel: the device half's error, in the user's file and line, at once
    cu.write_text(cu.read_text().replace("+ scalar_t(VA_ZERO);", "+ scalar_t(VA_ZERO) + not_declared;"))
    with pytest.raises(kload.CompileError) as e:
        build(cpp, cu)
    [d] = [d for d in e.value.diagnostics if "not_declared" in d.message]
    assert d.file == str(cu) and "not_declared" in d.source_line and "/split/" in str(e.value.log_path)

    # a launcher whose C++ types do not match the schema (issue 43): torch::Library's refusal is a
    # RegistrationError at the .cu's m.impl line (it used to abort while the library opened); the
    # library loaded before keeps serving
    cu.write_text(cu.read_text().replace(" + not_declared;", ";").replace(
        'KLOAD_IMPL(CUDA, m) { m.impl("vector_add", &vector_add_cuda); }',
        'at::Tensor wrong_types(const at::Tensor& a, int64_t b) { return a; }\n'
        'KLOAD_IMPL(CUDA, m) { m.impl("vector_add", &wrong_types); }'))
    with pytest.raises(kload.RegistrationError, match="vector_add.*Tensor vs int") as e:
        kload.load(cpp, cu, reload=False).load()
    line = next(i for i, t in enumerate(cu.read_text().splitlines(), 1) if "&wrong_types" in t)
    assert (e.value.file, e.value.line, e.value.op) == (str(cu), line, "vector_add")
    assert torch.equal(h.vector_add(x, x), 2 * x)


@needs_cuda
def test_constant_memory_and_accessors_link_through_the_halves(cache, tmp_path):
    """cudaMemcpyToSymbol from the launcher (the device half exports a reference to the
    variable's host shadow, which nvcc makes static), PackedTensorAccessor32 with
    RestrictPtrTraits (declared by torch for nvcc only), a header of the user's in the
    #include block and a fixed TORCH_LIBRARY in the .cu."""
    cu = tmp_path / "rows.cu"
    (tmp_path / "rows_index.h").write_text("#define ROWS_INDEX 0\n")
    cu.write_text(textwrap.dedent("""\
        #include <torch/extension.h>
        #include <ATen/cuda/CUDAContext.h>
        #include "rows_index.h"
        __constant__ float kScale[4];
        template <typename scalar_t>
        __global__ void rows_kernel(at::PackedTensorAccessor32<scalar_t, 2, at::RestrictPtrTraits> x) {
          x[blockIdx.x][threadIdx.x] *= static_cast<scalar_t>(kScale[ROWS_INDEX]);
        }
        at::Tensor rows(const at::Tensor& x, double s) {
          TORCH_CHECK(x.is_cuda(), "rows: x must be a CUDA tensor, got one on ", x.device());
          float h[4] = {float(s), 0, 0, 0};
          C10_CUDA_CHECK(cudaMemcpyToSymbol(kScale, h, sizeof(h)));
          AT_DISPATCH_FLOATING_TYPES_AND_HALF(x.scalar_type(), "rows", [&] {
            rows_kernel<scalar_t><<<x.size(0), x.size(1), 0, at::cuda::getCurrentCUDAStream()>>>(
                x.packed_accessor32<scalar_t, 2, at::RestrictPtrTraits>());
          });
          return x;
        }
        TORCH_LIBRARY(kload_split_rows, m) { m.def("rows(Tensor x, float s) -> Tensor"); }
        TORCH_LIBRARY_IMPL(kload_split_rows, CUDA, m) { m.impl("rows", &rows); }
        """))
    art, note = build(cu)
    assert note[str(cu)].startswith("split"), note
    assert len([k for k in fatbin_kernels(str(art)) if b"rows_kernel" in k]) == 3  # float, double, Half
    kload.load(cu, reload=False).load()
    x = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="rows: x must be a CUDA tensor"):
        torch.ops.kload_split_rows.rows.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), x, 2.0)


@needs_cuda
def test_a_torch_name_the_device_half_lacks_compiles_the_file_whole(cache, tmp_path):
    """A kernel that names c10::ScalarType (a host header of torch's, not in the device
    half): its first split fails and the file compiles whole, which the manifest and the
    build line say; remembered until the kernel stops naming it. Then the split compiles,
    and a later use of such a name compiles it whole again (the failing line names torch).
    (Its own cache entry: the whole builds are the point; c10/core/ScalarType.h keeps them ~4 s.)"""
    cpp, cu = tmp_path / "fb.cpp", tmp_path / "fb_cuda.cu"
    # (the op-library style: its namespace is new for each build, so one process loads all four)
    cpp.write_text('#define KLOAD_LEAN\n#include <kload/kernel.h>\nKLOAD_LIBRARY(m) { m.def("fb(int n) -> ()"); }\n')
    body = textwrap.dedent("""\
        #include <c10/core/ScalarType.h>
        __global__ void fb_kernel(int* y) { y[threadIdx.x] = VALUE; }
        void fb_launch(int* y) { fb_kernel<<<1, 32>>>(y); }
        """)
    cu.write_text(body.replace("VALUE", "static_cast<int>(c10::ScalarType::Float)"))
    _, note = build(cpp, cu)
    assert note[str(cu)].startswith("whole: its split did not compile (device half: fb_cuda.cu:2:"), note
    cu.write_text(body.replace("VALUE", "static_cast<int>(c10::ScalarType::Half)"))  # the same names: not tried
    _, again = build(cpp, cu)
    assert again == note
    cu.write_text(body.replace("VALUE", "7"))
    _, note = build(cpp, cu)
    assert note[str(cu)].startswith("split"), note
    cu.write_text(body.replace("VALUE", "static_cast<int>(c10::ScalarType::Double)"))
    _, note = build(cpp, cu)
    assert note[str(cu)].startswith("whole: its split did not compile"), note


@needs_cuda
def test_knob_off_compiles_whole_under_another_key(cache, tmp_path, monkeypatch):
    """KLOAD_SPLIT_CUDA=0: nvcc compiles the file whole, as before, under another key
    (the whole-file entries made before the split still hit with the knob off). Read
    from the plans: a whole build of a file with torch's headers costs ~40 s here."""
    cpp, cu = tmp_path / "off.cpp", tmp_path / "off.cu"
    shutil.copy(EXAMPLES / "tutorial_my_ops_cuda.cpp", cpp)
    shutil.copy(EXAMPLES / "tutorial_my_ops_cuda.cu", cu)

    def plan():
        opts = make_options(None, [cpp, cu], None, None, None, None, False, False, False)
        return make_plan(opts, Store(cache))

    on = plan()
    monkeypatch.setenv("KLOAD_SPLIT_CUDA", "0")
    off = plan()
    assert on.cuda_split and not off.cuda_split
    assert on.skey != off.skey and "cuda_split" not in off.key_inputs() and on.key_inputs()["cuda_split"] is True
    assert [u.source for u in SplitBuild(on, Store(cache), tmp_path / "ws").units] == [cu]
    assert SplitBuild(off, Store(cache), tmp_path / "ws").units == []
