#!/usr/bin/env bash
# On a GPU machine (no registry needed): build the shipped CUDA kernels through
# kload, run the CUDA tests, run the GPU benchmark. Under 5 minutes on one H200.
#   bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export KLOAD_CACHE_DIR=${KLOAD_CACHE_DIR:-$(mktemp -d)/kload}
export MAX_JOBS=${MAX_JOBS:-8} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
# kload's own dependencies (torch, ninja, filelock) are on the GPU image; install kload itself offline
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2 || true
$PY -c "import kload, torch; print('kload', kload.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
time $PY -c "
from kload import kernels
for op in kernels.__all__:
    h = kernels.handle(op)
    print(op, 'built:', h.build())
"
# the GPU image has no registry: run what its packages allow, and say what is missing
MISSING=$($PY -c "
import importlib.util as u
print(' '.join(m for m in ('ninja', 'filelock', 'pytest', 'hypothesis') if u.find_spec(m) is None))")
[ -n "$MISSING" ] && echo "gpu.sh: not installed here: $MISSING"
TESTS="tests/test_kernels_cuda.py"
case " $MISSING " in *" hypothesis "*) ;; *) TESTS="$TESTS tests/test_kernels.py" ;; esac
$PY -m pytest -q $TESTS -x -p no:cacheprovider
$PY benchmarks/gpu.py
