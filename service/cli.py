"""`dflash-trainer`: run the daemon (`serve`) and talk to it (`submit`, `status`, `cancel`).

Client commands take --url (default $DFLASH_URL or http://127.0.0.1:8000) and --token (default
$DFLASH_AUTH_TOKEN). Subcommands are argparse subparsers; `register_client_command` lets other
modules add their own (e.g. an `eval` command) with the same client options. The commands live in
service.cli_local (serve, precompile, export, eval) and service.cli_jobs (the client commands).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from .client import BadArgument, DaemonError, default_token, default_url
from .jobs.store import STATES

if TYPE_CHECKING:
    pass

from .cli_continual import register as register_continual
from .cli_jobs import (
    EXIT_BAD_REQUEST,
    EXIT_BROKEN_PIPE,
    EXIT_DAEMON_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    _job_state,
    _positive_int,
    cmd_cancel,
    cmd_logs,
    cmd_resume,
    cmd_status,
    cmd_submit,
)
from .cli_local import cmd_eval, cmd_export, cmd_precompile, cmd_serve


def add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=default_url(), help="daemon URL (default $DFLASH_URL or %(default)s)")
    parser.add_argument("--token", default=default_token(), help="bearer token (default $DFLASH_AUTH_TOKEN)")


def register_client_command(subparsers, name: str, handler: Callable[[argparse.Namespace], int], help_text: str):
    """A subcommand that talks to the daemon: gets --url/--token; returns its parser for more arguments."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    add_client_options(parser)
    parser.set_defaults(handler=handler)
    return parser


def register_local_command(
    subparsers, name: str, handler: Callable[[argparse.Namespace], int], help_text: str, description: str
):
    """A subcommand that runs in this process; returns its parser for its arguments."""
    parser = subparsers.add_parser(name, help=help_text, description=description)
    parser.set_defaults(handler=handler)
    return parser


DATA_DIR_HELP = "data directory (default $DFLASH_DATA_DIR or ~/.local/share/dflash-trainer)"


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
        "3 job STOPPED, 4 daemon unreachable, 5 daemon error, 130 interrupted, 141 output closed early",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_local_commands(sub)
    _add_client_commands(sub)
    return parser


def _add_local_commands(sub) -> None:
    serve = register_local_command(
        sub,
        "serve",
        cmd_serve,
        "run the daemon",
        "Run the training daemon (embedded default target without a config file).",
    )
    serve.add_argument("--config", help="TOML or YAML config file")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--data-dir", help=DATA_DIR_HELP)
    serve.add_argument("--log-json", action="store_true", help="log JSON lines")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a configuration setting, over the file's and the environment's (repeatable), e.g. "
        "--set engine.generate_slots=4",
    )
    serve.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration (and what serve would refuse) without starting the daemon; exit 0 or 2",
    )
    serve.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-host group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT; one process per host); implied when WORLD_SIZE > 1. Rank r>0 listens on port + LOCAL_RANK "
        "and keeps its files in DATA_DIR/ranks/r",
    )

    pre = register_local_command(
        sub,
        "precompile",
        cmd_precompile,
        "compile a config's kernels into its data directory, then exit",
        "Build and warm up the engine of a config without serving: fills the data directory's "
        "compile cache (and torch's portable compile artifacts), so that serve starts warm.",
    )
    pre.add_argument("--config", help="TOML or YAML config file")
    pre.add_argument("--data-dir", help=DATA_DIR_HELP)

    export = register_local_command(
        sub,
        "export",
        cmd_export,
        "write a serving directory from a drafter checkpoint",
        "Write config.json (with auto_map), modeling_dflash.py and model.safetensors for SGLang, vLLM "
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

    ev = register_local_command(
        sub,
        "eval",
        cmd_eval,
        "measure a checkpoint's acceptance length (tau)",
        "Greedy speculative decoding with the target and a drafter checkpoint, in this "
        "process (no daemon): prints tau and a small table.",
    )
    _add_eval_arguments(ev)

    comp = register_local_command(
        sub, "completion", cmd_completion, "print a shell completion script", cmd_completion.__doc__ or ""
    )
    comp.add_argument("shell", choices=["bash", "zsh"])


def _add_client_commands(sub) -> None:
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

    cancel = register_client_command(sub, "cancel", cmd_cancel, "stop a queued or running job")
    cancel.add_argument("job_id", metavar="JOB_ID")
    register_continual(sub, register_client_command)


def _add_eval_arguments(ev: argparse.ArgumentParser) -> None:
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
    ev.add_argument("--max-prompts", type=_positive_int, default=32)
    ev.add_argument("--max-new-tokens", type=_positive_int, default=64)
    ev.add_argument(
        "--check-lossless", action="store_true", help="also compare every output with target-only greedy decoding"
    )
    ev.add_argument("--data-dir", help="data directory for the embedded default")
    ev.add_argument("--json", action="store_true", help="print the raw JSON summary")


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


def main(argv: list[str] | None = None) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_went_away()
    except DaemonError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_REQUEST if 400 <= e.status < 500 else EXIT_DAEMON_ERROR
    except BadArgument as e:  # an argument or file no request can carry: the message names it
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    except httpx.InvalidURL as e:  # --url, or a path built from the arguments, is no URL httpx can send
        print(f"error: --url {getattr(args, 'url', '?')!r}: {e}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    except httpx.TransportError as e:
        print(f"error: cannot reach the daemon at {getattr(args, 'url', '?')}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        if args.command in ("submit", "logs"):
            print("\nstopped following; the job keeps running (dflash-trainer status / cancel)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _reader_went_away() -> int:
    """The reader of stdout closed it (`| head`): stop quietly, as a tool killed by SIGPIPE does,
    with its exit status; what is still buffered is dropped, not flushed into the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
