"""The shared remote cache (KLOAD_REMOTE_CACHE) against a redis-server on loopback,
started here in a temporary directory (Debian's `redis-server`).

    python benchmarks/remote.py [--reps 2] [--load-reps 5]

1. A cold cluster: 2 simulated nodes (cache directories) x 4 processes each load the
   tutorial's vector_add (examples/vector_add.cpp, <kload/kernel.h>) at once. Wall time until all 8 answered, and compiles,
   without the remote cache (each node compiles) and with it (one compile in total).
   Every rep starts from empty caches and an empty server; the sides alternate.
   KLOAD_PCH=0 on both sides (no background header builds in the figure).
2. Download and load of a 1 MB and a 50 MB artifact: the load call in a fresh
   process with an empty cache and a warm server, against a local hit in a fresh
   process. The sides alternate; min and median.
3. Chunks against one value: upload and download of the 50 MB artifact in-process
   with 4 MiB chunks (the default) and as one 64 MiB value, with the peak of Python
   memory (tracemalloc) during the download.
4. What the remote cache adds to an edit: in one process, a stable-ABI op is edited
   and reloaded (handle.reload(), then a call) with KLOAD_REMOTE_CACHE unset and set
   (each edit is a local miss: a lookup on the server, the lease, the build, the
   upload). Two processes, edits alternating between them; min and median.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import py  # noqa: E402

NODE = """
import json, logging, resource, time, torch, kload
logging.basicConfig(level=logging.INFO, format="%(message)s")
t = time.perf_counter()
ops = kload.load({src!r}, reload=False)
x = torch.arange(4.0)
out = ops.vector_add(x, x).tolist()
ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # the compilers this process ran
print(json.dumps([out, time.perf_counter() - t, ru.ru_utime + ru.ru_stime]))
"""

LOAD = """
import json, time, torch, kload
t = time.perf_counter()
ops = kload.load({src!r}, reload=False)
ops.{fn}(torch.ones(2))
print(json.dumps(time.perf_counter() - t))
"""

PADDED = """\
#include <kload/stable.h>
using kload::Tensor;
__attribute__((used)) static const unsigned char PAD[{size}] = {{1}};
Tensor {fn}(const Tensor& a) {{
  Tensor ac = torch::stable::contiguous(a);
  Tensor out = torch::stable::empty_like(ac);
  const float* pa = ac.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < ac.numel(); ++i) po[i] = pa[i] + PAD[0];
  return out;
}}
KLOAD_LIBRARY(m) {{ m.def("{fn}(Tensor a) -> Tensor"); }}
KLOAD_IMPL(CPU, m) {{ m.impl("{fn}", TORCH_BOX(&{fn})); }}
"""


def redis_server(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() \
            != "PONG":
        if time.monotonic() > deadline:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def cluster(work: Path, url: str | None) -> tuple[float, int, int, float, float]:
    """Wall seconds, compiles, downloads, compiler CPU seconds, and the slowest load call
    of 2 nodes x 4 processes, cold."""
    src = str(ROOT / "examples" / "vector_add.cpp")
    procs = []
    started = time.perf_counter()
    for i in range(8):
        env = dict(os.environ, KLOAD_CACHE_DIR=str(work / f"node-{i % 2}"), KLOAD_PCH="0", KLOAD_VERBOSE="0")
        env.pop("KLOAD_REMOTE_CACHE", None)
        if url:
            env["KLOAD_REMOTE_CACHE"] = url
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(NODE.format(src=src))], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    logs, cpu, calls = [], 0.0, []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a node failed:\n{out}\n{err}")
        answer, call, compiler_cpu = json.loads(out.strip().splitlines()[-1])
        if answer != [0.0, 2.0, 4.0, 6.0]:
            raise RuntimeError(f"a wrong answer: {answer}")
        logs.append(err)
        cpu += compiler_cpu
        calls.append(call)
    wall = time.perf_counter() - started
    text = "".join(logs)
    return wall, text.count("kload: built vector_add"), text.count("kload: downloaded vector_add"), cpu, max(calls)


def part_cluster(work: Path, reps: int) -> None:
    print("\n1. cold cluster, 2 nodes x 4 processes, the tutorial's vector_add as an op library "
          "(examples/vector_add.cpp: ATen's whole API), KLOAD_PCH=0")
    res = {"local only": [], "remote": []}
    for rep in range(reps):
        for side in (("local only", "remote") if rep % 2 == 0 else ("remote", "local only")):
            d = work / f"cluster-{rep}-{side.replace(' ', '-')}"
            d.mkdir()
            server = None
            url = None
            if side == "remote":
                server, url = redis_server(d)
            try:
                row = cluster(d, url)
            finally:
                if server:
                    server.kill()
                    server.wait()
            res[side].append(row)
            print(f"  rep {rep} {side:<10}: wall {row[0]:5.1f} s, {row[1]} compiles, {row[2]} downloads, "
                  f"compiler CPU {row[3]:5.1f} s, slowest load call {row[4]:5.1f} s")
    print(f"  {'side':<10} {'wall min':>9} {'wall med':>9} {'compiles':>9} {'CPU med':>8} {'call med':>9}")
    for side, rows in res.items():
        walls, cpus, calls = [r[0] for r in rows], [r[3] for r in rows], [r[4] for r in rows]
        print(f"  {side:<10} {min(walls):8.1f}s {statistics.median(walls):8.1f}s {rows[0][1]:>9} "
              f"{statistics.median(cpus):7.1f}s {statistics.median(calls):8.1f}s")
    med = {side: [statistics.median(r[i] for r in rows) for i in (0, 3)] for side, rows in res.items()}
    print(f"  remote / local only (medians): wall {med['remote'][0] / med['local only'][0]:.2f}x, "
          f"compiler CPU {med['remote'][1] / med['local only'][1]:.2f}x")


def part_download(work: Path, reps: int) -> Path:
    print("\n2. download and load (fresh process, empty cache, warm server) vs a local hit (fresh process)")
    server, url = redis_server(work)
    big = None
    try:
        for size, label in ((1 << 20, "1 MB"), (50 << 20, "50 MB")):
            fn = f"pad{size >> 20}mb"
            src = work / f"{fn}.cpp"
            src.write_text(PADDED.format(size=size, fn=fn))
            seed = work / f"seed-{fn}"
            env = {"KLOAD_CACHE_DIR": str(seed), "KLOAD_PCH": "0", "KLOAD_REMOTE_CACHE": url}
            t = time.perf_counter()
            py(LOAD.format(src=str(src), fn=fn), env=env)  # build and upload
            built = time.perf_counter() - t
            (entry,) = (seed / "entries").iterdir()
            art = next(p for p in entry.iterdir() if p.suffix == ".so")
            if size == 50 << 20:
                big = entry
            sides = ["local hit", "local full lookup", "download"]
            times = {side: [] for side in sides}
            for rep in range(reps):
                for side in sides if rep % 2 == 0 else sides[::-1]:
                    cache = seed
                    if side == "local full lookup":  # the entry without its hit record
                        cache = work / f"nohit-{fn}-{rep}"
                        shutil.copytree(seed, cache, symlinks=True, ignore=shutil.ignore_patterns("hits", "build"))
                    elif side == "download":
                        cache = work / f"fresh-{fn}-{rep}"
                    times[side].append(py(LOAD.format(src=str(src), fn=fn), env={**env, "KLOAD_CACHE_DIR": str(cache)}))
                    if cache != seed:
                        shutil.rmtree(cache)
            print(f"  {label} (artifact {art.stat().st_size / 1e6:.1f} MB; first build + upload {built:.1f} s):")
            for side in sides:
                t = times[side]
                print(f"    {side:<18} min {min(t) * 1e3:5.0f} ms, median {statistics.median(t) * 1e3:5.0f} ms, "
                      f"{statistics.median(t) / statistics.median(times['local hit']):6.1f}x the local hit")
    finally:
        server.kill()
        server.wait()
    return big


CHUNKS = """
import json, sys, time, tracemalloc
from pathlib import Path
from kload.cache import Entry, read_json
from kload.cache.remote import Remote
from kload.cache.store import Store
entry_dir, url, chunk, dest = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
m = read_json(entry_dir / "manifest.json")
r = Remote(url, password=None, secret=b"bench", timeout=30, ttl=None, chunk=chunk)
t = time.perf_counter(); r.upload(Entry(entry_dir, m)); up = time.perf_counter() - t
tracemalloc.start()
t = time.perf_counter(); got = r.download(Store(dest), m["source_key"], m["key"], m["name"]); down = time.perf_counter() - t
peak = tracemalloc.get_traced_memory()[1]
assert got is not None and got.manifest["sha256"] == m["sha256"]
print(json.dumps([up, down, peak]))
"""


def part_chunks(work: Path, entry: Path, reps: int) -> None:
    print(f"\n3. the 50 MB artifact in 4 MiB chunks vs one value (in-process; {reps} reps, alternating)")
    server, url = redis_server(work)
    try:
        res = {4 << 20: [], 64 << 20: []}
        for rep in range(reps):
            for chunk in ((4 << 20, 64 << 20) if rep % 2 == 0 else (64 << 20, 4 << 20)):
                subprocess.run(["redis-cli", "-u", url, "flushall"], capture_output=True, check=True)
                dest = work / f"chunks-{rep}-{chunk}"
                proc = subprocess.run([sys.executable, "-c", CHUNKS, str(entry), url, str(chunk), str(dest)],
                                      capture_output=True, text=True, check=True)
                res[chunk].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                shutil.rmtree(dest)
        for chunk, rows in res.items():
            up, down, peak = zip(*rows)
            label = "4 MiB chunks" if chunk == 4 << 20 else "one value"
            print(f"  {label:<12}: upload min {min(up) * 1e3:.0f} ms, median {statistics.median(up) * 1e3:.0f} ms; "
                  f"download min {min(down) * 1e3:.0f} ms, median {statistics.median(down) * 1e3:.0f} ms; "
                  f"download peak Python memory {max(peak) / 1e6:.0f} MB")
    finally:
        server.kill()
        server.wait()


EDITS = """
import json, sys, time, torch, kload
src = sys.argv[1]
text = open(src).read()
h = kload.load(src, reload=False)
h.sm(torch.ones(2))
from kload.compile import pch_build
pch_build.wait(timeout=600)  # the precompiled stable.h the first build started
for i in range(0, {n} + 1):  # edit 0 is untimed: the first build with the precompiled header
    input()  # the other side's edit is done
    with open(src, "w") as f:
        f.write(text.replace("* 3", f"* {{4 + i}}"))
    t = time.perf_counter()
    assert h.reload()
    assert h.sm(torch.ones(1)).item() == 4 + i
    print(json.dumps(time.perf_counter() - t), flush=True)
"""

EDITED = """\
#include <kload/stable.h>
using kload::Tensor;
Tensor sm(const Tensor& a) {
  Tensor ac = torch::stable::contiguous(a);
  Tensor out = torch::stable::empty_like(ac);
  const float* pa = ac.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < ac.numel(); ++i) po[i] = pa[i] * 3;
  return out;
}
KLOAD_LIBRARY(m) { m.def("sm(Tensor a) -> Tensor"); }
KLOAD_IMPL(CPU, m) { m.impl("sm", TORCH_BOX(&sm)); }
"""


def part_edit(work: Path, n: int) -> None:
    print(f"\n4. an edit of a stable-ABI op (precompiled stable.h), KLOAD_REMOTE_CACHE unset vs set ({n} edits each, "
          "alternating)")
    server, url = redis_server(work)
    procs = {}
    try:
        for side in ("unset", "set"):
            d = work / f"edit-{side}"
            d.mkdir()
            (d / "sm.cpp").write_text(EDITED)
            env = dict(os.environ, KLOAD_CACHE_DIR=str(d / "cache"))
            env.pop("KLOAD_REMOTE_CACHE", None)
            if side == "set":
                env["KLOAD_REMOTE_CACHE"] = url
            procs[side] = subprocess.Popen([sys.executable, "-c", EDITS.format(n=n), str(d / "sm.cpp")], env=env,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                           stderr=subprocess.DEVNULL)  # torch's "overriding a kernel" warning
        for p in procs.values():  # edit 0, untimed
            p.stdin.write("\n")
            p.stdin.flush()
            p.stdout.readline()
        res = {"unset": [], "set": []}
        for i in range(n):
            for side in (("unset", "set") if i % 2 == 0 else ("set", "unset")):
                procs[side].stdin.write("\n")
                procs[side].stdin.flush()
                res[side].append(json.loads(procs[side].stdout.readline()))
        for side, t in res.items():
            print(f"  remote cache {side:<5}: edit -> new result min {min(t):.2f} s, median {statistics.median(t):.2f} s")
        print(f"  set / unset (median): {statistics.median(res['set']) / statistics.median(res['unset']):.2f}x")
    finally:
        for p in procs.values():
            p.kill()
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2, help="cold-cluster reps per side")
    ap.add_argument("--load-reps", type=int, default=5, help="download/local-hit reps per side")
    ap.add_argument("--parts", default="1234", help="which parts to run (default: all)")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kload-remote-bench-") as tmp:
        work = Path(tmp)
        print(f"machine: {os.cpu_count()} cores; redis-server on loopback; MAX_JOBS={os.environ.get('MAX_JOBS')}")
        if "2" in args.parts or "3" in args.parts:
            big = part_download(work, args.load_reps)
            if "3" in args.parts:
                part_chunks(work, big, args.load_reps)
        if "4" in args.parts:
            part_edit(work, args.load_reps)
        if "1" in args.parts:
            part_cluster(work, args.reps)


if __name__ == "__main__":
    main()
