"""The daemon keeps the libraries' compiled bytecode on its data volume when Python cannot keep it
beside their sources: a first start fills <data_dir>/python-cache, a restart reads it instead of
compiling the sources again. Real interpreters on a real package tree."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

START = """
import json, subprocess, sys
from pathlib import Path
from service.bytecode import use_bytecode_cache
used = use_bytecode_cache(Path(sys.argv[1]), {"fakepkg": ("__init__.py",)})
import fakepkg
child = subprocess.run([sys.executable, "-c", "import sys; print(sys.pycache_prefix, sys.dont_write_bytecode)"],
                       capture_output=True, text=True).stdout.split()
print(json.dumps({"directory": used.directory, "reason": used.reason, "x": fakepkg.X,
                  "child_prefix": child[0], "child_writes": child[1] == "False"}))
"""


def fake_package(root: Path) -> Path:
    pkg = root / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    return pkg


def start(site: Path, cache: Path, **env: str) -> dict:
    """A fresh interpreter that sets the bytecode cache, then imports the package."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    base.update(env, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    out = subprocess.run(
        [sys.executable, "-c", START, str(cache)], cwd=REPO, env=base, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_size_and_mtime_edit(source: Path) -> None:
    """Change the source so that Python, which checks a pyc by the source's mtime and size, would
    still accept bytecode compiled from the old text: the module's value then tells which it ran."""
    st = source.stat()
    source.write_text("X = 2\n")
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_without_bytecode_beside_the_sources_a_restart_reads_the_data_dirs(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "data" / "python-cache"
    pkg = fake_package(site)
    first = start(site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert first["directory"] == str(cache) and "PYTHONDONTWRITEBYTECODE" in first["reason"]
    assert first["x"] == 1 and first["child_prefix"] == str(cache)  # children (compile workers) too
    assert first["child_writes"]
    assert list(cache.rglob("fakepkg/__init__*.pyc")), "nothing was written to the data dir"
    assert not (pkg / "__pycache__").exists(), "bytecode was written beside the sources"

    same_size_and_mtime_edit(pkg / "__init__.py")
    again = start(site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert again["directory"] == str(cache)
    assert again["x"] == 1, "the restart compiled the source again instead of reading the cached bytecode"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only modes")
def test_a_read_only_site_packages_uses_the_data_dir(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "data" / "python-cache"
    pkg = fake_package(site)
    pkg.chmod(0o555)
    try:
        used = start(site, cache)
    finally:
        pkg.chmod(0o755)
    assert used["directory"] == str(cache) and "read-only" in used["reason"]
    assert list(cache.rglob("fakepkg/__init__*.pyc"))


def test_current_bytecode_beside_the_sources_changes_nothing(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "data" / "python-cache"
    pkg = fake_package(site)
    py_compile.compile(str(pkg / "__init__.py"), doraise=True)  # as pip does at install
    used = start(site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert used["directory"] is None and "beside" in used["reason"] and not cache.exists()
    same_size_and_mtime_edit(pkg / "__init__.py")
    assert start(site, cache, PYTHONDONTWRITEBYTECODE="1")["x"] == 1  # Python read it from beside the source


def test_writable_sources_are_left_to_python(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "data" / "python-cache"
    pkg = fake_package(site)
    used = start(site, cache)
    assert used["directory"] is None and "writes" in used["reason"] and not cache.exists()
    assert list((pkg / "__pycache__").glob("__init__*.pyc"))


def test_an_exported_prefix_is_kept(tmp_path):
    site, mine = tmp_path / "site", tmp_path / "mine"
    fake_package(site)
    used = start(site, tmp_path / "data" / "python-cache", PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(mine))
    assert used["directory"] == str(mine) and "exported" in used["reason"]
    assert not (tmp_path / "data").exists()


def test_a_data_dir_that_cannot_hold_the_cache_leaves_python_as_it_is(tmp_path):
    site = tmp_path / "site"
    fake_package(site)
    blocker = tmp_path / "data"
    blocker.write_text("a file where the data directory should be")
    used = start(site, blocker / "python-cache", PYTHONDONTWRITEBYTECODE="1")
    assert used["directory"] is None and "cannot create" in used["reason"]
    assert used["x"] == 1 and used["child_prefix"] == "None"


@pytest.mark.parametrize(
    ("mode", "edit", "redirected"),
    [
        (py_compile.PycInvalidationMode.TIMESTAMP, True, True),  # the source changed since: stale
        (py_compile.PycInvalidationMode.CHECKED_HASH, False, False),
        (py_compile.PycInvalidationMode.CHECKED_HASH, True, True),  # Python checks the hash: stale
        (py_compile.PycInvalidationMode.UNCHECKED_HASH, True, False),  # Python uses it as it is
    ],
)
def test_bytecode_beside_the_sources_is_judged_as_python_judges_it(tmp_path, mode, edit, redirected):
    site, cache = tmp_path / "site", tmp_path / "data" / "python-cache"
    pkg = fake_package(site)
    py_compile.compile(str(pkg / "__init__.py"), doraise=True, invalidation_mode=mode)
    if edit:
        (pkg / "__init__.py").write_text("X = 1  # edited\n")
    used = start(site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert (used["directory"] == str(cache)) is redirected, used["reason"]


def test_serve_decides_before_it_imports_the_libraries():
    """What `serve` imports before its bytecode decision must not import the probed packages
    (the decision would come too late for them)."""
    code = (
        "import sys, uvicorn, service.cli, service.app, service.bytecode, service.http_guard, service.logs\n"
        "from service.config import load_config\n"
        "load_config(None)\n"
        "print(sorted(set(service.bytecode.PROBES) & set(sys.modules)))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
