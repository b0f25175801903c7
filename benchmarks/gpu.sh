#!/usr/bin/env bash
# Everything kload checks on a GPU machine, in one go, with the image's own settings
# (CXX, CUDAHOSTCXX, CUDA_HOME, LIBRARY_PATH untouched; no registry needed):
#
#   bash benchmarks/gpu.sh            # ~5-6 minutes on one H200 (not yet run on one: an estimate)
#
# Each part runs whatever happened before it; the last line is the summary, PASS or
# FAIL per part, and the exit status is 1 when a part failed. Run it from the repo;
# it installs kload (offline, no dependencies) into the Python it finds.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export KLOAD_CACHE_DIR=${KLOAD_CACHE_DIR:-$(mktemp -d)/kload}
export PYTHONUNBUFFERED=1
OUT=${GPU_OUT:-benchmarks/out}
mkdir -p "$OUT"
declare -a SUMMARY=()
FAILED=0

part() {  # part NAME COMMAND...: run it, record PASS/FAIL, go on
  local name=$1; shift
  echo; echo "=== $name: $*"
  local t0=$SECONDS
  if "$@"; then SUMMARY+=("$name PASS ($((SECONDS - t0)) s)")
  else SUMMARY+=("$name FAIL ($((SECONDS - t0)) s)"); FAILED=1; fi
}

echo "CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-} CUDA_HOME=${CUDA_HOME:-} LIBRARY_PATH=${LIBRARY_PATH:-}" \
     "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-(unset: kload builds for the GPU here)}"
# kload's own dependencies that a bare GPU image lacks are optional where they are not
# needed (platformdirs, watchdog, redis); the tests' are named, and skipped around
MISSING=$($PY -c "
import importlib.util as u
print(' '.join(m for m in ('ninja', 'filelock', 'tqdm', 'pytest', 'hypothesis', 'expecttest', 'platformdirs',
                           'watchdog', 'matplotlib') if u.find_spec(m) is None))")
[ -n "$MISSING" ] && echo "gpu.sh: not installed here (carry wheels to use them): $MISSING"

install() { $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
            (cd /tmp && $PY -c "import kload, torch; print('kload', kload.__version__, 'torch', torch.__version__,
                'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')
assert torch.cuda.is_available()"); }
part install install

build_kernels() { $PY -c "
import time
from kload import kernels
t = time.perf_counter()
for op in kernels.__all__:
    kernels.handle(op).build()
print(f'the four shipped kernels built in {time.perf_counter() - t:.1f} s')"; }
part build build_kernels

PYTEST="$PY -m pytest -q -p no:cacheprovider"
DESELECT=()
case " $MISSING " in *" expecttest "*) DESELECT+=(-k "not opcheck");; esac
part toolchain $PYTEST tests/test_toolchain.py
TESTS="tests/test_kernels_cuda.py tests/test_nvrtc.py"
case " $MISSING " in *" hypothesis "*) ;; *) TESTS="$TESTS tests/test_kernels.py";; esac
part cuda-tests $PYTEST $TESTS "${DESELECT[@]}"
part tutorial-cu $PY benchmarks/tutorial_gpu.py
part benchmark $PY benchmarks/gpu.py --out "$OUT"
part gemm-shapes $PY benchmarks/gemm_shapes.py
part nvrtc-benchmark $PY benchmarks/nvrtc.py --repeat 9

echo
echo "gpu.sh summary: $(IFS=';'; echo "${SUMMARY[*]}" | sed 's/;/; /g')"
exit $FAILED
