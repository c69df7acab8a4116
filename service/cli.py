"""`dflash-trainer`: run the daemon (`serve`) and talk to it (`submit`, `status`, `cancel`).

Client commands take --url (default $DFLASH_URL or http://127.0.0.1:8000) and --token (default
$DFLASH_AUTH_TOKEN). Subcommands are argparse subparsers; `register_client_command` lets other
modules add their own (e.g. an `eval` command) with the same client options.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from dflash_core.engine.launch import Launch

from .client import DaemonClient, DaemonError, default_token, default_url
from .jobs.schemas import BUILTIN_SCHEME, SpecError, resolve_builtin
from .jobs.store import STATES, TERMINAL
from .progress import StepRate, duration, progress_line

if TYPE_CHECKING:
    from .config import ServiceConfig

# Exit codes, distinct per outcome (scripts and CI branch on them; the README lists them)
EXIT_OK = 0  # the command did what it was asked; a followed job SUCCEEDED
EXIT_JOB_FAILED = 1
EXIT_BAD_REQUEST = 2  # the daemon refused the request (4xx), or the arguments or files are wrong
EXIT_JOB_STOPPED = 3
EXIT_UNREACHABLE = 4  # no daemon answered at --url
EXIT_DAEMON_ERROR = 5  # the daemon answered with a server error (5xx)
EXIT_INTERRUPTED = 130
EXIT_CODES = {"SUCCEEDED": EXIT_OK, "FAILED": EXIT_JOB_FAILED, "STOPPED": EXIT_JOB_STOPPED}
# how long a follower keeps reconnecting to a daemon that went away (a restart takes seconds to
# minutes: warm-up); then it gives up with EXIT_UNREACHABLE
RECONNECT_SECONDS = 900.0


# --------------------------------------------------------------------------- serve
def untrusted_store(config: Any) -> str | None:
    """Why the job store in the data directory must not be used (its records name the paths and
    roots jobs write under): see dflash_core.trust."""
    from dflash_core.trust import problem

    for suffix in ("", "-wal", "-shm", "-journal"):
        path = config.database_path.with_name(config.database_path.name + suffix)
        if (why := problem(path, config.data_dir)) is not None:
            return f"the job store {why}; the data directory must be as trusted as the daemon (see the README)"
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .bytecode import BYTECODE_DIR, use_bytecode_cache
    from .config import ConfigError, is_loopback_host, is_wildcard_host, load_config
    from .http_guard import MAX_REQUEST_HEAD_BYTES, bounded_h11_protocol
    from .logs import configure_logging

    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "data_dir": args.data_dir,
        "log_level": args.log_level,
        "log_json": True if args.log_json else None,
    }
    try:
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
    log_config = configure_logging(json_lines=config.log_json, level=config.log_level)
    log = logging.getLogger("dflash.service")
    use_bytecode_cache(config.data_dir / BYTECODE_DIR)  # before the engine's thread imports torch
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


def for_rank(config: ServiceConfig, launch: Launch) -> ServiceConfig:
    """A rank's own port and files: ranks on one host (e.g. a test's, on the CPU) must not share a
    port or a data directory; rank 0 keeps both as configured. Devices are not split by LOCAL_RANK:
    a group runs one process per host, which drives all of the host's GPUs."""
    port = config.port + launch.local_rank if config.port else 0
    data_dir = config.data_dir / "ranks" / str(launch.rank) if launch.rank > 0 else config.data_dir
    return config.model_copy(update={"port": port, "data_dir": data_dir})


def cmd_precompile(args: argparse.Namespace) -> int:
    """Build and warm the engine of a config without serving: fills the data directory's compile
    cache (and writes torch's portable compile artifacts there) for an image build stage or an
    init container, so that `serve` on that data directory starts warm."""
    from .bytecode import BYTECODE_DIR, use_bytecode_cache
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
    from dflash_core.engine import Engine

    t = time.monotonic()
    engine = Engine(config.engine, config.data_dir)
    try:
        engine.build()
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


# --------------------------------------------------------------------------- client commands
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _events_reconnecting(
    client: DaemonClient, job_id: str, out: TextIO, reconnect_seconds: float
) -> Iterator[dict[str, Any]]:
    """The job's events until it ends, resuming after the last one seen (?after=) when the stream
    breaks or the daemon restarts; gives up after `reconnect_seconds` without an answer."""
    import httpx

    after = 0
    while True:
        try:
            for event in client.events(job_id, follow=True, after=after):
                after = max(after, int(event.get("event_id") or 0))
                yield event
            if client.job(job_id)["state"] in TERMINAL:
                return
        except (httpx.TransportError, DaemonError) as e:
            if isinstance(e, DaemonError) and e.status < 500:
                raise
        # the stream ended or broke while the job runs: the daemon went away (a restart)
        out.write(("\r\033[K" if out.isatty() else "") + "daemon unreachable; reconnecting...\n")
        out.flush()
        deadline = time.monotonic() + reconnect_seconds
        while True:
            try:
                client.job(job_id)
                break
            except (httpx.TransportError, DaemonError) as e:
                if isinstance(e, DaemonError) and e.status < 500:
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


def follow_job(
    client: DaemonClient,
    job_id: str,
    out: TextIO = sys.stdout,
    *,
    quiet_steps_seconds: float = 1.0,
    reconnect_seconds: float = RECONNECT_SECONDS,
) -> dict[str, Any]:
    """Stream the job's events, drawing a progress line; returns the job when it ends. Survives a
    daemon restart (the events resume where they stopped)."""
    tty = out.isatty()
    last_print = 0.0
    pending_line = ""
    rate = StepRate()  # on the events' timestamps: a re-attached follower gets the past in one burst
    for event in _events_reconnecting(client, job_id, out, reconnect_seconds):
        kind = event["kind"]
        rate.observe(event)
        if kind == "step":
            elapsed, eta = rate.times(event.get("total_steps") or 0)
            pending_line = progress_line(event, elapsed, eta)
            now = time.monotonic()
            if tty:
                out.write("\r" + pending_line)
                out.flush()
            elif now - last_print >= quiet_steps_seconds or event.get("step") == event.get("total_steps"):
                out.write(pending_line + "\n")
                out.flush()
                last_print = now
            continue
        message = _event_message(event)
        if message:
            out.write(("\r\033[K" if tty else "") + message + "\n")
            if tty and pending_line:
                out.write(pending_line)
            out.flush()
    if tty:
        out.write("\n")
    return client.job(job_id)


def _event_message(event: dict[str, Any]) -> str | None:
    kind = event["kind"]
    if kind == "state":
        extra = f": {event['error']}" if event.get("error") else ""
        return f"state {event.get('state')}{extra}"
    if kind == "checkpoint":
        return f"checkpoint step {event.get('step')}: {event.get('path')}"
    if kind == "eval":
        return f"eval step {event.get('step')}: acceptance length {_fmt(event.get('acceptance_length'), '.3f')}"
    if kind == "resumed":
        return f"resumed from step {event.get('step')} ({event.get('reason')}): {event.get('checkpoint')}"
    if kind == "data":
        return (
            f"data: {event.get('documents')} documents, {event.get('micro_batches_per_epoch')} micro-batches per epoch,"
            f" {event.get('total_steps')} steps"
        )
    if kind == "generate":
        return generation_line(event)
    if kind == "decoder":
        return (
            f"decoder: {event.get('slots')} slots x {event.get('length')} positions, KV cache "
            f"{(event.get('kv_cache_bytes') or 0) / 2**30:.2f} GiB, CUDA graph {'yes' if event.get('cuda_graph') else 'no'}"
        )
    if kind == "prompts":
        return f"prompts: {event.get('prompts')}, {event.get('rows')} rows in {event.get('shards')} shards"
    if kind == "skipped_lines":
        return f"skipped {event.get('count')} bad dataset lines, first: {event.get('first')}"
    if kind == "first_step":  # seconds per phase before the job's first step, and their total
        phases = dict(event.get("seconds") or {})
        total = phases.pop("total", None)
        parts = ", ".join(f"{name} {_fmt(v, '.2f')} s" for name, v in phases.items())
        return f"first step after {_fmt(total, '.2f')} s ({parts})"
    if kind in ("cancel_requested", "interrupted"):
        return kind.replace("_", " ")
    return None


def generation_line(p: dict[str, Any]) -> str:
    """A regeneration's progress (a `generate` event, or a job's progress.data)."""
    return (
        f"prompts {p.get('prompts_done')}/{p.get('prompts_total')}  rows {p.get('rows_done')}/{p.get('rows_total')}"
        f"  {p.get('tokens_generated')} tokens  {_fmt(p.get('tokens_per_second'), ',.0f')} tok/s"
        f"  ETA {duration(p.get('eta_seconds'))}"
    )


def _client(args: argparse.Namespace) -> DaemonClient:
    return DaemonClient(args.url, args.token)


def cmd_submit(args: argparse.Namespace) -> int:
    path = Path(args.job_file)
    try:
        spec = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"error: {path}: no such file", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"error: {path}: not valid JSON: {e}", file=sys.stderr)
        return 2
    if args.name:
        spec["name"] = args.name
    if args.submission_id:
        spec["submission_id"] = args.submission_id
    with _client(args) as client:
        status, job = client.submit(spec)
        verb = "queued" if status == 202 else "already submitted"
        print(f"{job['id']} {verb} ({job['state']})")
        if not args.follow:
            return 0
        job = follow_job(client, job["id"])
        _print_outcome(job)
        return EXIT_CODES.get(job["state"], 1)


def _print_outcome(job: dict[str, Any]) -> None:
    p = job["progress"]
    print(f"{job['id']} {job['state']} at step {p['step']}/{p['total_steps']}")
    if p.get("last_checkpoint"):
        print(f"checkpoint: {p['last_checkpoint']}")
    if p.get("eval_acceptance_length") is not None:
        print(f"eval acceptance length: {p['eval_acceptance_length']:.3f}")
    if job.get("error"):
        print(f"error: {job['error']}")


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.job_id:
            job = client.job(args.job_id)
            if args.json:
                print(json.dumps(job, indent=2))
            else:
                p = job["progress"]
                print(f"id          {job['id']}\nname        {job['name'] or '-'}\nstate       {job['state']}")
                if job.get("kind") == "regenerate":
                    print(f"kind        regenerate\nprogress    {generation_line(p.get('data') or {})}")
                    print(f"output      {job['output_dir']}")
                    if job.get("error"):
                        print(f"error       {job['error']}")
                    return 0
                print(f"step        {p['step']}/{p['total_steps'] or '?'}\nloss        {_fmt(p['loss'], '.4f')}")
                print(f"tokens/s    {_fmt(p['tokens_per_second'], ',.0f')}\ncheckpoint  {p['last_checkpoint'] or '-'}")
                print(f"eval tau    {_fmt(p['eval_acceptance_length'], '.3f')}\noutput      {job['output_dir']}")
                if job.get("error"):
                    print(f"error       {job['error']}")
            return 0
        jobs = client.jobs(state=args.state, limit=args.limit)
        if args.json:
            print(json.dumps(jobs, indent=2))
            return 0
        _, health = client.health()
        print(
            f"daemon {client.url}: {health['status']} ({health.get('phase')}, "
            f"{health.get('drafters_ready')}/{health.get('drafters_total')} drafters)"
        )
        if not jobs:
            print(f"no {args.state.upper()} jobs" if args.state else "no jobs")
            return 0
        print(f"{'ID':<18} {'STATE':<10} {'STEP':>13} {'LOSS':>8} {'TOK/S':>9}  NAME")
        for job in jobs:
            p = job["progress"]
            step = f"{p['step']}/{p['total_steps'] or '?'}"
            print(
                f"{job['id']:<18} {job['state']:<10} {step:>13} {_fmt(p['loss'], '.4f'):>8} "
                f"{_fmt(p['tokens_per_second'], ',.0f'):>9}  {job['name'] or ''}"
            )
        return 0


def _job_state(value: str) -> str:
    if value.upper() not in STATES:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(STATES)}")
    return value.upper()


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return n


def cmd_resume(args: argparse.Namespace) -> int:
    """POST /jobs/{id}/resume; with --follow, the job's progress until it ends."""
    with _client(args) as client:
        job = client.resume(args.job_id)
        print(f"{job['id']} {job['state']}: resumes from its newest checkpoint when its turn comes")
        if not args.follow:
            return EXIT_OK
        job = follow_job(client, job["id"])
        _print_outcome(job)
        return EXIT_CODES.get(job["state"], EXIT_JOB_FAILED)


def cmd_logs(args: argparse.Namespace) -> int:
    """A job's events as lines (like `ray job logs`); with --follow, until the job ends, across
    daemon restarts. The exit code is the job's when it was followed to its end."""
    with _client(args) as client:
        if args.follow:
            job = follow_job(client, args.job_id)
            _print_outcome(job)
            return EXIT_CODES.get(job["state"], EXIT_JOB_FAILED)
        for event in client.events(args.job_id):
            if args.json:
                print(json.dumps(event))
            elif event["kind"] == "step":
                print(progress_line(event))
            elif (message := _event_message(event)) is not None:
                print(message)
        return EXIT_OK


def cmd_completion(args: argparse.Namespace) -> int:
    """A shell completion script for the commands and options (bash and zsh via bashcompinit)."""
    parser = build_parser()
    commands: dict[str, list[str]] = {}
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name, sub in getattr(action, "choices", {}).items():
            commands[name] = sorted(o for a in sub._actions for o in a.option_strings if o.startswith("--"))
    cases = "\n".join(f'        {name}) opts="{" ".join(opts)}" ;;' for name, opts in commands.items())
    print(f"""# dflash-trainer completion (bash); load with: eval "$(dflash-trainer completion bash)"
_dflash_trainer() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" cmd="${{COMP_WORDS[1]}}" opts
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W "{" ".join(commands)} --version --help" -- "$cur")); return
    fi
    case "$cmd" in
{cases}
        *) opts="" ;;
    esac
    if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "$opts" -- "$cur")); else COMPREPLY=($(compgen -f -- "$cur")); fi
}}
complete -F _dflash_trainer dflash-trainer""")
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.job_id)
        if job["state"] in TERMINAL:
            print(f"{job['id']} {job['state']}")
        else:
            print(f"{job['id']} stops at its next step (a checkpoint is written)")
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


# --------------------------------------------------------------------------- parser
def add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=default_url(), help="daemon URL (default $DFLASH_URL or %(default)s)")
    parser.add_argument("--token", default=default_token(), help="bearer token (default $DFLASH_AUTH_TOKEN)")


def register_client_command(subparsers, name: str, handler: Callable[[argparse.Namespace], int], help_text: str):
    """A subcommand that talks to the daemon: gets --url/--token; returns its parser for more arguments."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    add_client_options(parser)
    parser.set_defaults(handler=handler)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("dflash-trainer")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-trainer",
        description="DFlash drafter training daemon",
        epilog="exit codes: 0 done (a followed job SUCCEEDED), 1 job FAILED, 2 bad request or arguments, "
        "3 job STOPPED, 4 daemon unreachable, 5 daemon error, 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Run the training daemon (embedded default target without a config file).",
    )
    serve.add_argument("--config", help="TOML or YAML config file")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--data-dir", help="data directory (default $DFLASH_DATA_DIR or ~/.local/share/dflash-trainer)")
    serve.add_argument("--log-json", action="store_true", help="log JSON lines")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-host group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT; one process per host); implied when WORLD_SIZE > 1. Rank r>0 listens on port + LOCAL_RANK "
        "and keeps its files in DATA_DIR/ranks/r",
    )
    serve.set_defaults(handler=cmd_serve)

    pre = sub.add_parser(
        "precompile",
        help="compile a config's kernels into its data directory, then exit",
        description="Build and warm up the engine of a config without serving: fills the data directory's "
        "compile cache (and torch's portable compile artifacts), so that serve starts warm.",
    )
    pre.add_argument("--config", help="TOML or YAML config file")
    pre.add_argument("--data-dir", help="data directory (default $DFLASH_DATA_DIR or ~/.local/share/dflash-trainer)")
    pre.set_defaults(handler=cmd_precompile)

    export = sub.add_parser(
        "export",
        help="write a serving directory from a drafter checkpoint",
        description="Write config.json (with auto_map), modeling_dflash.py and model.safetensors for SGLang, vLLM "
        "or transformers' AutoModel(trust_remote_code=True), without the training state.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT")
    export.add_argument("out", metavar="OUT", help="a directory that does not exist yet")
    export.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="weights dtype (default auto: the dtype of the target the checkpoint was trained for)",
    )
    export.set_defaults(handler=cmd_export)

    submit = register_client_command(sub, "submit", cmd_submit, "submit a job file (JSON job spec)")
    submit.add_argument("job_file", metavar="JOB.json")
    submit.add_argument("--follow", "-f", action="store_true", help="follow progress until the job ends")
    submit.add_argument("--name", help="override the job's name")
    submit.add_argument("--submission-id", help="idempotency key: resubmitting returns the same job")

    status = register_client_command(sub, "status", cmd_status, "show the daemon's jobs, or one job")
    status.add_argument("job_id", nargs="?", metavar="JOB_ID")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.add_argument("--state", type=_job_state, help="only jobs in this state (" + ", ".join(STATES) + ")")
    status.add_argument("--limit", type=_positive_int, metavar="N", help="only the newest N jobs")

    resume = register_client_command(
        sub,
        "resume",
        cmd_resume,
        "put a FAILED or STOPPED job back in the queue: it resumes from its newest checkpoint",
    )
    resume.add_argument("job_id", metavar="JOB_ID")
    resume.add_argument("--follow", "-f", action="store_true", help="follow the job until it ends")

    logs = register_client_command(sub, "logs", cmd_logs, "print a job's events; --follow re-attaches to a running job")
    logs.add_argument("job_id", metavar="JOB_ID")
    logs.add_argument("--follow", "-f", action="store_true", help="follow until the job ends (across daemon restarts)")
    logs.add_argument("--json", action="store_true", help="one JSON event per line")

    comp = sub.add_parser("completion", help="print a shell completion script", description=cmd_completion.__doc__)
    comp.add_argument("shell", choices=["bash", "zsh"])
    comp.set_defaults(handler=cmd_completion)

    cancel = register_client_command(sub, "cancel", cmd_cancel, "stop a queued or running job")
    cancel.add_argument("job_id", metavar="JOB_ID")

    ev = sub.add_parser(
        "eval",
        help="measure a checkpoint's acceptance length (tau)",
        description="Greedy speculative decoding with the target and a drafter checkpoint, in this "
        "process (no daemon): prints tau and a small table.",
    )
    ev.add_argument("--checkpoint", required=True, help="drafter checkpoint directory")
    ev.add_argument(
        "--prompts",
        required=True,
        help="JSONL conversations (prompt = up to the first assistant turn), or builtin://heldout",
    )
    ev.add_argument(
        "--target", help="target model dir (default: the --config daemon's target, else the embedded default)"
    )
    ev.add_argument("--config", help="the daemon's config file: evaluate with its engine.target_path")
    ev.add_argument("--device", default="cpu", help="cpu or cuda:N (default %(default)s)")
    ev.add_argument("--max-prompts", type=int, default=32)
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument(
        "--check-lossless", action="store_true", help="also compare every output with target-only greedy decoding"
    )
    ev.add_argument("--data-dir", help="data directory for the embedded default")
    ev.add_argument("--json", action="store_true", help="print the raw JSON summary")
    ev.set_defaults(handler=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except DaemonError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_REQUEST if 400 <= e.status < 500 else EXIT_DAEMON_ERROR
    except httpx.TransportError as e:
        print(f"error: cannot reach the daemon at {getattr(args, 'url', '?')}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        if args.command in ("submit", "logs"):
            print("\nstopped following; the job keeps running (dflash-trainer status / cancel)", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
