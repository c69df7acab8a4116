"""bench.suite_cpu: a real pytest run whose test starts a process that burns CPU, the process found
with the test that started it, and the tables' kinds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bench.suite_cpu import kind_of, main, summarize
from tests.helpers import REPO_ROOT

# half a second of CPU, then a second idle: the poller reads the whole of it before the process ends
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(1)\n"


def test_kinds_follow_the_command_line():
    worker = "/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))"
    assert kind_of(worker).startswith("pytest workers")
    assert kind_of("/venv/bin/python -m service.cli serve --config c.toml").startswith("daemons")
    assert kind_of("/venv/bin/python -m service.cli status --url u").startswith("CLI calls")
    assert kind_of("/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet x.cpp").startswith("C++")
    assert kind_of("/venv/bin/python -m tests.decode_attention_check --decoder").startswith("interpreted")
    assert kind_of("/venv/bin/python -u -m tests.distributed.engine_rank d").startswith("ranks")
    assert kind_of("/bin/sleep 1") == "other"


def test_worker_time_is_not_given_to_a_module():
    procs = [
        {"cmd": "python -u -c import sys;exec(eval(sys.stdin.readline()))", "test": "tests/a.py::t (call)", "cpu": 9.0},
        {"cmd": "python -m service.cli serve", "test": "tests/a.py::t (setup)", "cpu": 3.0},
        {"cmd": "python -m service.cli serve", "test": "tests/b.py::u (call)", "cpu": 1.0},
    ]
    kinds, modules = summarize(procs, top=5)
    assert [k["kind"][:7] for k in kinds] == ["pytest ", "daemons"]
    assert kinds[1]["processes"] == 2 and kinds[1]["share"] == "31 %"
    assert modules == [
        {"test module": "tests/a.py", "processes": 1, "CPU s": "3.0"},
        {"test module": "tests/b.py", "processes": 1, "CPU s": "1.0"},
    ]


def test_a_bad_interval_is_refused_before_the_suite(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--interval", "0"])
    assert e.value.code == 2 and "--interval" in capsys.readouterr().err


@pytest.mark.slow  # a pytest run in a fresh interpreter, and a child that burns half a second
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_child_of_a_test_is_found_with_its_test(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_burns.py").write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys

            def test_starts_a_burner():
                subprocess.run([sys.executable, "-c", {BURN!r}], check=True)
            """
        )
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.suite_cpu",
            "--interval",
            "0.05",
            "--",
            "-q",
            "-p",
            "no:cacheprovider",
            str(suite),
        ],
        cwd=suite,
        env=dict(os.environ, OUT=str(tmp_path / "out"), PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout
    record = json.loads((tmp_path / "out" / "suite_cpu.json").read_text())
    burner = [p for p in record["processes"] if "process_time" in p["cmd"]]
    assert len(burner) == 1
    assert burner[0]["test"].startswith("test_burns.py::test_starts_a_burner")
    assert burner[0]["cpu"] >= 0.45
    assert "test_burns.py" in out.stdout.split("test module")[-1]
