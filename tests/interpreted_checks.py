"""Several of the CPU checks of Triton kernels through Triton's interpreter (tests/*_check.py) in
one fresh interpreter: `TRITON_INTERPRET=1 python -m tests.interpreted_checks "tests.ce_check"
"tests.ce_check --fp8" ...` (the flag is read when a kernel module is imported). Each argument is
a check module and its flags; prints one JSON object with, under each argument, the module's
main(flags) as "result", or the check's traceback as "error" (one check's failure is its tests'
alone). One interpreter for all: torch, Triton and the kernels are imported once, and the
interpreter's rewrite of a kernel serves every check that launches it (on 2 cores the checks
cost about 40% more CPU in an interpreter each)."""

from __future__ import annotations

import importlib
import json
import sys
import traceback


def run(checks: list[str]) -> dict:
    out: dict = {}
    for check in checks:
        module, *flags = check.split()
        try:
            out[check] = {"result": importlib.import_module(module).main(flags)}
        except Exception:  # noqa: BLE001 - reported under the check, whose tests fail with it
            out[check] = {"error": traceback.format_exc()}
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
