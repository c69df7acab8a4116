"""The data directory is as trusted as the code: what the daemon loads and runs from it (compile
artifacts, inductor's cache, the Python bytecode cache, the job store) is refused, with the
reason, when another user owns it or every user may write it, as sshd's StrictModes does. A
group-writable (Kubernetes fsGroup) volume keeps working. Tests run as root, so a planted file is
one chowned to another uid."""

from __future__ import annotations

import marshal
import os
import subprocess
from pathlib import Path

import pytest

from dflash_core.trust import problem, tree_problem
from tests.helpers import run_cli
from tests.service.harness import write_config
from tests.service.test_bytecode import fake_package, start

STRANGER = 4242  # a uid that is neither root nor the daemon's user


def test_a_planted_bytecode_file_is_not_run(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "data" / "python-cache"
    pkg = fake_package(site)
    first = start(site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert first["directory"] == str(cache) and first["x"] == 1
    (pyc,) = cache.rglob("fakepkg/__init__*.pyc")
    header = pyc.read_bytes()[:16]  # still matches the source's mtime and size: Python would accept it
    pyc.write_bytes(header + marshal.dumps(compile("X = 666\n", str(pkg / "__init__.py"), "exec")))
    os.chown(pyc, STRANGER, STRANGER)
    again = start(site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert again["x"] == 1, "the planted bytecode ran"
    assert again["directory"] is None and "owned by uid 4242" in again["reason"], again
    os.chown(pyc, os.getuid(), os.getgid())
    pyc.chmod(0o666)  # writable by every user: refused as well
    assert "writable by every user" in start(site, cache, PYTHONDONTWRITEBYTECODE="1")["reason"]


@pytest.mark.slow  # starts a daemon of its own
def test_a_planted_compile_artifacts_file_is_refused(make_daemon):
    d = make_daemon(start=False)
    d.data_dir.mkdir(parents=True, exist_ok=True)
    artifacts = d.data_dir / "compile-artifacts.bin"
    artifacts.write_bytes(b"not ours")
    os.chown(artifacts, STRANGER, STRANGER)
    d.start()
    d.wait_ready()
    log = d.log()
    assert "compile artifacts refused" in log and "owned by uid 4242" in log, log[-3000:]


def _serve(data_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    config = write_config(tmp_path / "dflash.toml", data_dir)
    return run_cli("serve", "--config", str(config), "--port", "0", cwd=tmp_path)


def test_a_foreign_or_world_writable_job_store_stops_the_daemon(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    store = data_dir / "dflash.sqlite3"
    store.write_bytes(b"")
    os.chown(store, STRANGER, STRANGER)
    out = _serve(data_dir, tmp_path)
    assert out.returncode == 2 and "refusing to serve" in out.stderr and "owned by uid 4242" in out.stderr, out.stderr
    os.chown(store, os.getuid(), os.getgid())
    store.chmod(0o666)
    out = _serve(data_dir, tmp_path)
    assert out.returncode == 2 and "writable by every user" in out.stderr, out.stderr


def test_a_group_writable_fsgroup_volume_is_trusted(tmp_path):
    """As Kubernetes mounts an fsGroup volume: the root owned by root (here: another uid), group-
    writable and setgid; the daemon's files in it group-writable."""
    data_dir = tmp_path / "volume"
    data_dir.mkdir()
    os.chown(data_dir, STRANGER, 2000)
    data_dir.chmod(0o2775)
    cache = data_dir / "python-cache" / "lib"
    cache.mkdir(parents=True)
    (cache / "m.pyc").write_bytes(b"")
    for p in (data_dir / "python-cache", cache, cache / "m.pyc"):
        os.chown(p, os.getuid(), 2000)
        p.chmod(0o775 if p.is_dir() else 0o664)
    assert tree_problem(data_dir / "python-cache", data_dir) is None
    data_dir.chmod(0o777)  # writable by every user, not sticky: anyone could swap the cache
    assert "writable by every user" in (problem(cache / "m.pyc", data_dir) or "")
    data_dir.chmod(0o1777)  # sticky, as /tmp: others cannot rename what they do not own
    assert problem(cache / "m.pyc", data_dir) is None


def test_a_planted_inductor_cache_is_not_used(tmp_path, monkeypatch):
    from dflash_core.engine.compile import trusted_cache_dir

    # as in a fresh daemon: an exported variable (torch sets one once it compiled) would win over the default
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    data_dir = tmp_path / "data"
    kernel = data_dir / "inductor-cache" / "ab" / "kernel.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("import os\n")
    assert trusted_cache_dir(data_dir / "inductor-cache", data_dir)[0] == str(data_dir / "inductor-cache")
    os.chown(kernel, STRANGER, STRANGER)
    used, why = trusted_cache_dir(data_dir / "inductor-cache", data_dir)
    assert used != str(data_dir / "inductor-cache") and "owned by uid 4242" in why
