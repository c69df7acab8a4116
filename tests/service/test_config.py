"""ServiceConfig: defaults, TOML/YAML files, DFLASH_* environment, flags; and the CLI parser."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from service.config import ConfigError, load_config


def test_defaults_need_no_file_and_never_use_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(env={"HOME": str(tmp_path / "home")})
    assert cfg.host == "127.0.0.1" and cfg.port == 8000 and cfg.auth_token is None
    assert cfg.data_dir == tmp_path / "home" / ".local" / "share" / "dflash-trainer"
    assert cfg.engine.target_path is None  # the embedded default
    assert cfg.engine.drafter_devices is None  # chosen from the host when the engine is built
    assert cfg.resolved_output_roots() == [cfg.data_dir.resolve()]
    assert cfg.data_dir.resolve() in cfg.resolved_dataset_roots()


def test_the_data_dir_follows_xdg_for_the_daemon_and_the_smollm2_tool(tmp_path, monkeypatch):
    from dflash_core.targets import smollm2

    home, xdg = tmp_path / "home", tmp_path / "xdg"
    monkeypatch.delenv("DFLASH_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_DATA_HOME", str(xdg))
    cfg = load_config(env={"HOME": str(home), "XDG_DATA_HOME": str(xdg)})
    assert cfg.data_dir == xdg / "dflash-trainer"
    assert smollm2.default_out() == cfg.data_dir / "targets" / smollm2.NAME  # `make smollm2` writes there
    monkeypatch.setenv("DFLASH_DATA_DIR", str(tmp_path / "mine"))
    assert load_config(env={"DFLASH_DATA_DIR": str(tmp_path / "mine")}).data_dir == tmp_path / "mine"
    assert smollm2.default_out() == tmp_path / "mine" / "targets" / smollm2.NAME


def test_a_relative_xdg_or_home_never_puts_the_data_dir_in_the_current_directory(tmp_path):
    import pwd

    home = tmp_path / "home"
    assert load_config(env={"HOME": str(home), "XDG_DATA_HOME": "rel"}).data_dir == (
        home / ".local" / "share" / "dflash-trainer"
    )
    own = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".local" / "share" / "dflash-trainer"
    assert load_config(env={"HOME": "."}).data_dir == own
    assert load_config(env={"HOME": ".", "XDG_DATA_HOME": "rel"}).data_dir == own
    assert all(load_config(env=env).data_dir.is_absolute() for env in ({"HOME": ""}, {"XDG_DATA_HOME": "x"}))


def test_toml_file_env_and_flags_override_in_order(tmp_path):
    path = tmp_path / "conf" / "dflash.toml"
    path.parent.mkdir()
    path.write_text(
        'port = 9000\ndata_dir = "state"\nauth_token = "from-file"\n\n[engine]\n'
        'seq_len = 256\nnum_anchors = 16\ndrafter_devices = ["cpu"]\n'
    )
    cfg = load_config(path, env={})
    assert cfg.port == 9000
    assert cfg.data_dir == tmp_path / "conf" / "state"  # relative to the file, not the cwd
    assert cfg.engine.shape.seq_len == 256

    env = {
        "DFLASH_PORT": "9100",
        "DFLASH_AUTH_TOKEN": "from-env",
        "DFLASH_ENGINE__NUM_ANCHORS": "32",
        "DFLASH_ENGINE__TARGET_DEVICES": "cpu,cpu",
        "DFLASH_URL": "http://not-a-config-field",
    }
    cfg = load_config(path, env=env)
    assert (cfg.port, cfg.auth_token, cfg.engine.num_anchors) == (9100, "from-env", 32)
    assert cfg.engine.target_devices == ["cpu", "cpu"]
    assert cfg.engine.seq_len == 256  # the file's value survives an env override of another engine field

    cfg = load_config(path, env=env, overrides={"port": 9200, "host": None})
    assert cfg.port == 9200 and cfg.host == "127.0.0.1"


def test_yaml_file(tmp_path):
    path = tmp_path / "dflash.yaml"
    path.write_text("host: 0.0.0.0\nlog_json: true\nengine:\n  block_size: 16\n  debug_eager: true\n")
    cfg = load_config(path, env={"DFLASH_DATA_DIR": str(tmp_path / "d")})
    assert cfg.host == "0.0.0.0" and cfg.log_json is True
    assert cfg.data_dir == tmp_path / "d"
    assert cfg.engine.shape.block_size == 16 and cfg.engine.debug_eager


@pytest.mark.parametrize(
    "text, words",
    [
        ("port = 'eighty'", ["port"]),
        ("[engine]\nseq_len = 1", ["engine.seq_len"]),
        ("[engine]\ndrafter_devices = ['gpu0']", ["engine.drafter_devices"]),
        ("colour = 'blue'", ["colour"]),
        ("port = ", ["dflash.toml"]),
        ("[engine]\nnum_anchors = 0", ["engine.num_anchors"]),
        # what the device decides is not a setting: the variants that used to be settings are refused
        *[
            (f"[engine]\n{name} = {value}", [f"engine.{name}", "Extra inputs"])
            for name, value in (
                ("attention", "'dense'"),
                ("compile", "true"),
                ("compile_scope", "'layer'"),
                ("flex_q_splits", "1"),
                ("loss_kernel", "'triton'"),
                ("working_weights", "'bf16'"),
                ("compile_workers", "'early'"),
                ("init_seed", "0"),
                ("warmup_delay_seconds", "1.0"),
                ("queue_depth", "4"),
            )
        ],
    ],
)
def test_invalid_config_names_the_field(tmp_path, text, words):
    path = tmp_path / "dflash.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    for word in words:
        assert word in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


def test_cli_parser_has_subcommands_and_client_options():
    from service.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--config", "x.toml", "--port", "9001", "--data-dir", "/tmp/d"])
    assert (args.command, args.config, args.port, args.data_dir) == ("serve", "x.toml", 9001, "/tmp/d")
    args = parser.parse_args(["submit", "job.json", "--follow", "--url", "http://h:1", "--token", "t"])
    assert (args.job_file, args.follow, args.url, args.token) == ("job.json", True, "http://h:1", "t")
    assert parser.parse_args(["status"]).job_id is None
    assert parser.parse_args(["cancel", "job-1"]).job_id == "job-1"


def test_example_jobs_are_valid_specs():
    from service.jobs.by_kind import parse_spec

    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.json"))
    assert examples
    for path in examples:
        spec = parse_spec(json.loads(path.read_text()))
        assert spec.datasets


def test_missing_target_path_is_a_config_error(tmp_path):
    import pytest

    from service.config import ConfigError, load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[engine]\ntarget_path = "{tmp_path / "nowhere"}"\n')
    with pytest.raises(ConfigError, match=r"engine.target_path: .*nowhere.*no config\.json"):
        load_config(cfg, env={})


def test_step_plan_follows_the_devices():
    """How the step runs is derived from the drafter devices: compiled flex attention on CUDA (with
    the Triton CE kernel and bf16 working weights where Triton imports), the eager dense path as
    soon as one drafter is on the CPU, and the eager path everywhere with debug_eager."""
    from dflash_core.engine.config import CPU_PLAN, step_plan

    assert step_plan(["cpu"]) == CPU_PLAN == step_plan(["cuda:0", "cpu"]) == step_plan(["cuda:0"], debug_eager=True)
    cuda = step_plan(["cuda:0", "cuda:1"])
    assert (cuda.attention, cuda.compiled) == ("flex", True)
    try:
        import triton  # noqa: F401
    except ImportError:
        assert (cuda.loss, cuda.working_weights) == ("compiled", "fp32")
    else:
        assert (cuda.loss, cuda.working_weights) == ("triton", "bf16")


def test_a_target_split_over_devices_is_a_nested_list(tmp_path):
    path = tmp_path / "dflash.toml"
    path.write_text('[engine]\ntarget_devices = [["cuda:0", "cuda:1"], "cuda:2"]\ndrafter_devices = ["cuda:3"]\n')
    assert load_config(path, env={}).engine.target_devices == [["cuda:0", "cuda:1"], "cuda:2"]
    env = {"DFLASH_ENGINE__TARGET_DEVICES": '[["cuda:0", "cuda:1"]]'}
    assert load_config(None, env=env).engine.target_devices == [["cuda:0", "cuda:1"]]
    path.write_text('[engine]\ntarget_devices = [["cuda:0", "gpu1"]]\n')
    with pytest.raises(ConfigError, match=r"engine\.target_devices"):
        load_config(path, env={})


def test_serve_check_validates_without_starting(tmp_path):
    """serve --check answers whether the configuration would serve, and starts nothing: no port,
    no data directory written."""
    from tests.helpers import run_cli

    data_dir = tmp_path / "data"
    good = tmp_path / "good.toml"
    good.write_text(f'data_dir = "{data_dir}"\nport = 8123\n')
    done = run_cli("serve", "--config", str(good), "--check", cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and "configuration OK" in done.stdout and "8123" in done.stdout, done.stderr
    assert not data_dir.exists()
    bad = tmp_path / "bad.toml"
    bad.write_text(f'data_dir = "{data_dir}"\n[engine]\nqueue_depth = "four"\n')
    done = run_cli("serve", "--config", str(bad), "--check", cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "queue_depth" in done.stderr, done.stderr
    exposed = tmp_path / "exposed.toml"
    exposed.write_text(f'data_dir = "{data_dir}"\nhost = "0.0.0.0"\n')
    done = run_cli("serve", "--config", str(exposed), "--check", cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "refusing to serve" in done.stderr, done.stderr


def test_serve_set_overrides_a_setting(tmp_path):
    """--set section.key=value takes a setting over the file's, values read as TOML; a setting
    that is wrong is named, and so is an assignment that is not KEY=VALUE."""
    from tests.helpers import run_cli

    data_dir = tmp_path / "data"
    file = tmp_path / "c.toml"
    file.write_text(f'data_dir = "{data_dir}"\nport = 8123\n[engine]\ngenerate_slots = 2\n')
    base = ("serve", "--config", str(file), "--check")
    done = run_cli(*base, "--set", "port=9321", "--set", "engine.generate_slots=4", cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and ":9321," in done.stdout, done.stdout + done.stderr
    done = run_cli(*base, "--set", "engine.generate_slots=four", cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "engine.generate_slots" in done.stderr, done.stderr
    done = run_cli(*base, "--set", "engine.generate_slots", cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "KEY=VALUE" in done.stderr, done.stderr
    from service.cli_local import settings_from

    config = load_config(file, env={}, overrides=settings_from(["engine.generate_slots=4", 'log_level="debug"']))
    assert config.engine.generate_slots == 4 and config.log_level == "debug"


def test_serve_raises_the_soft_open_file_limit_to_the_hard_one():
    """A daemon holds mapped cache entries, connections and worker pipes at once: `serve` lifts a
    shell's or a container's low soft limit to what the system allows it (in a child: the limit is
    the process's)."""
    import subprocess
    import sys

    script = (
        "import logging, resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "from service.cli_local import raise_open_file_limit\n"
        "raise_open_file_limit(logging.getLogger('t'))\n"
        "now, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "print(now == hard or (hard == resource.RLIM_INFINITY and now >= 1 << 20))\n"
    )
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=60)
    assert run.stdout.strip() == "True", run
