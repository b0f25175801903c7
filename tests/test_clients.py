"""Real, unmodified clients of torch.utils.cpp_extension, routed through kload by
KLOAD_PATCH_TORCH=1 (read at `import kload`): DeepSpeed's CPU Adam (its op builder
JIT-compiles `cpu_adam` through torch's loader when the optimizer is made) and SRU
(which builds its CPU op through torch's loader at import). Each runs in fresh
processes: a cold one builds, a second one loads with zero compiles. Cold and warm
times against torch's own loader: benchmarks/clients.py."""
from __future__ import annotations

import pytest

from conftest import compiles, run_py

pytest.importorskip("deepspeed", reason="the test extra installs deepspeed")

DEEPSPEED = """
    import json, os, time
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    {use}
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    shapes = [(257, 129), (1000,), (33, 7, 5)]
    p_ds = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    p_ref = [torch.nn.Parameter(p.detach().clone()) for p in p_ds]
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt = DeepSpeedCPUAdam(p_ds, adamw_mode=False, **kw)  # adamw_mode=False: torch.optim.Adam's L2 decay
    ref = torch.optim.Adam(p_ref, **kw)
    for _ in range(3):
        for a, b in zip(p_ds, p_ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    out = {{"diff": max((a - b).abs().max().item() for a, b in zip(p_ds, p_ref))}}
    if {kload}:
        import kload
        out["how"] = [h["how"] for h in kload.HISTORY]
        out["patched"] = kload.cpp_extension.is_patched()
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_deepspeed_cpu_adam_builds_through_kload(tmp_path, cxx_wrapper):
    script, log = cxx_wrapper
    # unmodified, through kload: KLOAD_PATCH_TORCH=1 and an `import kload` before the optimizer; its
    # three steps are checked against torch.optim.Adam (a build with torch's own loader, which this
    # test once made too, checked torch's loader, not kload: benchmarks/clients.py times the two)
    env = {"KLOAD_PATCH_TORCH": "1", "CXX": str(script), "KLOAD_PCH": "0"}
    before = compiles(log)  # the wrapper's log is the session's
    cold = run_py(DEEPSPEED.format(use="import kload", kload=True), env=env)
    assert cold["patched"] and cold["how"] == ["built"] and cold["diff"] < 1e-5
    n = compiles(log)
    assert n - before == 2  # cpu_adam.cpp and cpu_adam_impl.cpp
    warm = run_py(DEEPSPEED.format(use="import kload", kload=True), env=env)
    assert warm["how"] == ["cache"] and warm["diff"] == cold["diff"]
    assert compiles(log) == n  # a second process compiles nothing


SRU = """
    import json, warnings
    warnings.simplefilter("ignore")
    import torch, kload          # KLOAD_PATCH_TORCH=1: patched before sru binds torch's `load`
    import sru                   # builds sru_cuda (falls back to its dummy without CUDA) and sru_cpu
    import sru.ops
    out = {"bound": sru.ops.load.__module__, "how": [[h["name"], h["how"]] for h in kload.HISTORY]}
    torch.manual_seed(0)
    diffs = []
    for bidir in (False, True):
        m = sru.SRU(input_size=16, hidden_size=16, num_layers=2, bidirectional=bidir, dropout=0.0).eval()
        x = torch.randn(7, 3, 16)
        h_ref, c_ref = m(x)            # grad enabled: SRU's pure-PyTorch recurrence
        with torch.no_grad():
            h, c = m(x)                # no_grad: its C++ op, torch.ops.sru_cpu.cpu_(bi_)forward
        diffs.append(max((h - h_ref).abs().max().item(), (c - c_ref).abs().max().item()))
    out["diffs"] = diffs
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_sru_builds_its_cpu_op_through_kload_at_import(cxx_wrapper):
    pytest.importorskip("sru", reason="the test extra installs sru")
    script, log = cxx_wrapper
    env = {"KLOAD_PATCH_TORCH": "1", "CXX": str(script), "KLOAD_PCH": "0"}
    before = compiles(log)
    cold = run_py(SRU, env=env)
    assert cold["bound"] == "kload.cpp_extension"
    # sru_cuda's .cu cannot build here: kload raises OSError as torch does, SRU falls back to its dummy
    assert cold["how"] == [["sru_cuda", "built"], ["sru_cpu", "built"]]
    assert max(cold["diffs"]) < 1e-5
    n = compiles(log)
    assert n - before == 2
    warm = run_py(SRU, env=env)
    assert warm["how"] == [["sru_cuda", "cache"], ["sru_cpu", "cache"]] and warm["diffs"] == cold["diffs"]
    assert compiles(log) == n
