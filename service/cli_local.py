"""The commands that run in this process: `serve` (the daemon), `precompile`, `export`, `eval`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_core.data_home import BYTECODE_DIR, RANKS_DIR
from dflash_core.engine.launch import Launch

from .jobs.paths import BUILTIN_SCHEME, resolve_builtin
from .jobs.schemas import SpecError

if TYPE_CHECKING:
    from .config import ServiceConfig


def untrusted_store(config: Any) -> str | None:
    """Why the job store in the data directory must not be used (its records name the paths and
    roots jobs write under): see dflash_core.trust."""
    from dflash_core.trust import problem

    for suffix in ("", "-wal", "-shm", "-journal"):
        path = config.database_path.with_name(config.database_path.name + suffix)
        if (why := problem(path, config.data_dir)) is not None:
            return f"the job store {why}; the data directory must be as trusted as the daemon (see the README)"
    return None


def settings_from(assignments: list[str]) -> dict[str, Any]:
    """`--set section.key=value` assignments as the nested settings a config file would hold; the
    value is read as a TOML value (a number, a boolean, a quoted string, a list), else taken as
    the string it is. ConfigError naming an assignment that is not KEY=VALUE."""
    import tomllib

    from .config import ConfigError

    out: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(part.strip() for part in parts):
            raise ConfigError(f"--set {assignment!r}: give KEY=VALUE, e.g. --set engine.generate_slots=4")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part.strip(), {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {assignment!r}: {part.strip()!r} was set to a value above")
            node = child
        node[parts[-1].strip()] = value
    return out


def _check_only(config: Any) -> int:
    """serve --check: what serve would refuse, found without starting anything (no engine, no
    port, nothing written); a config that passes is summarised, one that does not exits 2."""
    target = config.engine.target_path  # load_config checked it holds a config.json
    print(
        f"configuration OK: serves {config.host}:{config.port}, data_dir {config.data_dir}, target "
        f"{target if target is not None else 'the embedded default'}, drafters on "
        f"{', '.join(config.engine.drafter_devices) if config.engine.drafter_devices else 'the default devices'}"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .bytecode import use_bytecode_cache
    from .config import ConfigError, is_loopback_host, is_wildcard_host, load_config
    from .http_guard import MAX_REQUEST_HEAD_BYTES, bounded_h11_protocol
    from .logs import configure_logging

    flags: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "data_dir": args.data_dir,
        "log_level": args.log_level,
        "log_json": True if args.log_json else None,
    }
    try:
        overrides = {
            **settings_from(getattr(args, "set", None) or []),
            **{k: v for k, v in flags.items() if v is not None},
        }
        config = load_config(args.config, overrides=overrides)
    except ConfigError as e:
        print(f"dflash-trainer: invalid configuration: {e}", file=sys.stderr)
        return 2
    try:
        launch = Launch.from_env()
    except ValueError as e:
        print(f"dflash-trainer: {e}", file=sys.stderr)
        return 2
    if getattr(args, "distributed", False) and launch is None:
        print(
            "dflash-trainer: --distributed needs a launcher's environment with WORLD_SIZE > 1 (start it with "
            "torchrun --nnodes N --nproc-per-node 1 ... -m service.cli serve)",
            file=sys.stderr,
        )
        return 2
    if launch is not None:
        config = for_rank(config, launch)
    if (launch is None or launch.rank == 0) and (problem := config.exposure_problem()) is not None:
        print(f"dflash-trainer: refusing to serve: {problem}", file=sys.stderr)
        return 2
    if (problem := untrusted_store(config)) is not None:
        print(f"dflash-trainer: refusing to serve: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "check", False):
        return _check_only(config)
    log_config = configure_logging(json_lines=config.log_json, level=config.log_level)
    log = logging.getLogger("dflash.service")
    use_bytecode_cache(config.data_dir / BYTECODE_DIR)  # before the engine's thread imports torch
    raise_open_file_limit(log)
    if not is_loopback_host(config.host) and config.auth_token is None:
        log.warning(
            "listening on %s without auth_token (allow_unauthenticated): anyone who reaches this port can "
            "submit and cancel jobs",
            config.host,
        )
    if is_wildcard_host(config.host) and not config.allowed_hosts:
        log.warning(
            "listening on %s with no allowed_hosts: only requests addressed to localhost names are answered "
            "(421 otherwise); list the names clients use in allowed_hosts",
            config.host,
        )
    app = create_app(config, launch)
    daemon = app.state.daemon

    class DaemonServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # before uvicorn drains connections: stop the running job at its next step (checkpointed,
            # resumable) and end event streams, so open `follow` streams do not hold the shutdown
            daemon.begin_shutdown()
            super().handle_exit(sig, frame)

    server = DaemonServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=log_config,
            log_level=config.log_level,
            timeout_graceful_shutdown=10,
            access_log=config.log_level == "debug",
            # a request must arrive whole within request_timeout_seconds (uvicorn bounds only the idle
            # time between requests), and its head is at most MAX_REQUEST_HEAD_BYTES (else 400)
            http=bounded_h11_protocol(config.request_timeout_seconds),
            timeout_keep_alive=config.keep_alive_timeout_seconds,
            h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
            server_header=False,
        )
    )
    server.run()
    return daemon.exit_code if server.started else 1


def raise_open_file_limit(log: logging.Logger) -> None:
    """The soft limit on open files up to the hard one, as long-running servers do: the daemon
    holds a corpus's memory-mapped cache entries, its connections and its compile workers' pipes
    at once, and a login shell's or a container's soft limit (often 1024) is far below what the
    system allows it."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                log.info("open-file limit raised", extra={"fields": {"from": soft, "to": target}})
    except (ImportError, ValueError, OSError) as e:  # another platform, or a limit the system keeps
        log.info("open-file limit kept", extra={"fields": {"reason": str(e)}})


def for_rank(config: ServiceConfig, launch: Launch) -> ServiceConfig:
    """A rank's own port and files: ranks on one host (e.g. a test's, on the CPU) must not share a
    port or a data directory; rank 0 keeps both as configured. Devices are not split by LOCAL_RANK:
    a group runs one process per host, which drives all of the host's GPUs."""
    port = config.port + launch.local_rank if config.port else 0
    data_dir = config.data_dir / RANKS_DIR / str(launch.rank) if launch.rank > 0 else config.data_dir
    return config.model_copy(update={"port": port, "data_dir": data_dir})


def cmd_precompile(args: argparse.Namespace) -> int:
    """Build and warm the engine of a config without serving: fills the data directory's compile
    cache (and writes torch's portable compile artifacts there) for an image build stage or an
    init container, so that `serve` on that data directory starts warm."""
    from .bytecode import use_bytecode_cache
    from .config import ConfigError, load_config
    from .logs import configure_logging

    try:
        config = load_config(args.config, overrides={"data_dir": args.data_dir})
    except ConfigError as e:
        print(f"dflash-trainer: invalid configuration: {e}", file=sys.stderr)
        return 2
    configure_logging(json_lines=config.log_json, level=config.log_level)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    use_bytecode_cache(config.data_dir / BYTECODE_DIR)  # what `serve` on this data directory reads
    from dflash_core.libraries import import_engine_libraries

    import_engine_libraries()
    from dflash_core.engine import Engine

    t = time.monotonic()
    engine = Engine(config.engine, config.data_dir)
    try:
        engine.build(checkpoints=False)  # it trains nothing: no buffers to pin
        saved = engine.save_compile_artifacts()
        status = engine.status()
    except Exception as e:  # noqa: BLE001 - the build's failure is the command's result
        print(f"dflash-trainer: precompile failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    print(
        json.dumps(
            {
                "ready_seconds": round(time.monotonic() - t, 1),
                "compiled_graphs": status.compiles["warmup"],
                "artifacts_bytes": saved,
                "data_dir": str(config.data_dir),
                "drafters": list(status.drafter_devices),
            }
        )
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A serving directory from a drafter checkpoint (also one written before checkpoints
    carried their modeling file)."""
    from dflash_core.checkpoint import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    except (FileNotFoundError, FileExistsError, ValueError, OSError) as e:
        print(f"dflash-trainer: export failed: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Acceptance length of a checkpoint on held-out prompts, computed in this process."""
    from dflash_core.evaluate import evaluate_checkpoint

    from .config import default_data_dir

    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    prompts = args.prompts
    if prompts.startswith(BUILTIN_SCHEME):
        try:
            prompts = str(resolve_builtin(prompts, "--prompts", data_dir))
        except SpecError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for label, path in (("--checkpoint", Path(args.checkpoint) / "config.json"), ("--prompts", Path(prompts))):
        if not path.exists():
            print(f"error: {label}: {path} does not exist", file=sys.stderr)
            return 2
    target = args.target
    if target is None and args.config:  # the daemon's target
        from .config import ConfigError, load_config

        try:
            target_dir = load_config(Path(args.config)).engine.target_path
        except (ConfigError, OSError, ValueError) as e:
            print(f"error: --config: {e}", file=sys.stderr)
            return 2
        target = str(target_dir) if target_dir is not None else None
    try:
        summary = evaluate_checkpoint(
            args.checkpoint,
            prompts,
            target_path=target,
            device=args.device,
            max_prompts=args.max_prompts,
            max_new_tokens=args.max_new_tokens,
            data_dir=str(data_dir),
            check_lossless=args.check_lossless,
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"checkpoint {summary['checkpoint']}\ntarget     {summary['target']}")
    if summary.get("target_matches") is False:
        print("warning: this target's config differs from the one the drafter was trained with", file=sys.stderr)
    print(
        f"tau (mean acceptance length) = {summary['acceptance_length']:.3f} over {summary['blocks']} blocks, "
        f"{summary['prompts']} prompts"
    )
    print("accepted per block: " + "  ".join(f"{k}:{v}" for k, v in summary["histogram"].items()))
    if "lossless_mismatches" in summary:
        print(f"outputs differing from target-only greedy decoding: {summary['lossless_mismatches']}")
    print(f"\n{'tau':>6}  {'prompt (end)':<40}  output (start)")
    for row in summary["per_prompt"]:
        print(f"{row['acceptance_length']:>6.2f}  {row['prompt'][-40:]:<40}  {row['output'][:50]}")
    return 0
