"""Where a warm start's seconds go before any drafter compiles: imports and CUDA initialisation.

    python -m bench.startup_probe

Each measurement runs in a fresh interpreter (imports are cached per process):
  imports   the daemon's import chain in its order, seconds per step
  torch     torch.cuda.init() and a tensor per device in a side thread while the main thread
            counts Python loop turns: if the longest gap between turns is about the init's length,
            the init holds the GIL (the engine's CudaContexts thread then blocks the build thread
            instead of overlapping it)
  daemon    the same after torch.cuda.is_available() + device_count() in the main thread, as the
            daemon's build thread does before it creates the engine
  cuinit    the same with the driver's cuInit called first through ctypes (which releases the GIL)
Writes $OUT/startup_probe.json; prints a table last.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import out_dir, print_table

IMPORT_CHAIN = [
    ("service.app (fastapi, uvicorn, pydantic)", "import uvicorn, service.app"),
    ("torch", "import torch"),
    ("dflash_core.engine", "import dflash_core.engine"),
    ("transformers AutoConfig/AutoTokenizer", "from transformers import AutoConfig, AutoTokenizer"),
    ("transformers Qwen3ForCausalLM", "from transformers import Qwen3ForCausalLM"),
    ("torch._dynamo", "import torch._dynamo"),
    ("torch._inductor.compile_fx", "import torch._inductor.compile_fx"),
    ("torch.nn.attention.flex_attention", "import torch.nn.attention.flex_attention"),
]

IMPORTS = """
import json, time
steps = {steps!r}
out = []
for name, stmt in steps:
    t = time.perf_counter(); exec(stmt); out.append((name, time.perf_counter() - t))
print(json.dumps(out))
"""

# a side thread initialises CUDA; the main thread records the longest gap between loop turns
CUDA_INIT = """
import ctypes, json, threading, time
import torch
mode = {mode!r}
done, result = threading.Event(), {{}}
if mode == "daemon":  # what the daemon does first, in the build thread: count the devices
    t = time.perf_counter()
    result["device_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    result["is_available_and_count_s"] = time.perf_counter() - t
def init():
  try:
    t = time.perf_counter()
    if mode == "cuinit":
        rc = ctypes.CDLL("libcuda.so.1").cuInit(0)
        result["cuinit_rc"] = rc
        result["cuinit_s"] = time.perf_counter() - t
    t1 = time.perf_counter()
    torch.cuda.init()
    result["torch_cuda_init_s"] = time.perf_counter() - t1
    for d in range(torch.cuda.device_count()):
        t2 = time.perf_counter()
        torch.empty(1, device=f"cuda:{{d}}")
        result[f"context_cuda:{{d}}_s"] = time.perf_counter() - t2
    result["thread_total_s"] = time.perf_counter() - t
  except Exception as e:
    result["error"] = repr(e)
  finally:
    done.set()
th = threading.Thread(target=init); th.start()
last, gap, turns = time.perf_counter(), 0.0, 0
while not done.is_set():
    now = time.perf_counter(); gap = max(gap, now - last); last = now; turns += 1
    time.sleep(0.001)
th.join()
result["main_thread_longest_stall_s"] = gap
result["main_thread_turns"] = turns
print(json.dumps(result))
if "error" in result:
    raise SystemExit(result["error"])
"""


def run_python(code: str) -> dict | list:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    record: dict = {}
    rows = []
    for attempt in range(2):  # the first pays for a cold page cache
        steps = run_python(IMPORTS.format(steps=IMPORT_CHAIN))
        record[f"imports_{attempt}"] = steps
    for name, seconds in record["imports_1"]:
        rows.append({"what": f"import {name}", "seconds": round(seconds, 3)})
    rows.append({"what": "imports in all", "seconds": round(sum(s for _, s in record["imports_1"]), 3)})
    for mode in ("daemon", "torch", "cuinit"):
        try:
            res = run_python(CUDA_INIT.format(mode=mode))
        except RuntimeError as e:  # no GPU, no driver
            rows.append({"what": f"{mode}: failed", "seconds": str(e).strip().splitlines()[-1][:80]})
            continue
        record[f"cuda_init_{mode}"] = res
        for key, value in res.items():
            rows.append({"what": f"{mode}: {key}", "seconds": round(value, 3) if isinstance(value, float) else value})
    (out_dir() / "startup_probe.json").write_text(json.dumps(record, indent=1))
    print_table(rows, ["what", "seconds"])


if __name__ == "__main__":
    main()
