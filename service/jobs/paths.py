"""Where a job's paths may lead, and how its messages name them.

`Roots` is the one rule for the allowed roots: a job reads (datasets, eval prompts, chat template)
under the dataset roots, writes (output_dir) under the output roots, and starts from a checkpoint
(init_from) under either; every path is resolved with its symlinks followed before it is judged.
The engine checks the same roots again when it reads and writes (dflash_core.confine), so a path
swapped for a symlink while the job waits is still refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_core.confine import UnsafeFile, read_regular, under
from dflash_core.data_home import ASSETS_DIR, DAEMON_DIRS

from .schemas import SpecError

if TYPE_CHECKING:
    from ..config import ServiceConfig

BUILTIN_SCHEME = "builtin://"
BUILTIN_DATASETS = ("train", "heldout")
MAX_TEMPLATE_BYTES = 1024 * 1024


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or type(e).__name__


@dataclass(frozen=True)
class Roots:
    """The configured roots of one daemon; relative paths are taken from `data_dir`."""

    data_dir: Path
    reads: tuple[Path, ...]
    writes: tuple[Path, ...]

    @classmethod
    def of(cls, config: ServiceConfig) -> Roots:
        return cls(config.data_dir, tuple(config.resolved_dataset_roots()), tuple(config.resolved_output_roots()))

    def reading_also(self, extra: Iterable[Path]) -> Roots:
        """These roots, with more directories to read (the outputs of job:// datasets)."""
        return replace(self, reads=(*self.reads, *extra))

    def for_engine(self) -> dict[str, list[str]]:
        """The roots the engine re-checks at every read and write; the builtin datasets live in the
        data directory."""
        return {
            "dataset_roots": [str(r) for r in [*self.reads, (self.data_dir / ASSETS_DIR).resolve()]],
            "output_roots": [str(r) for r in self.writes],
        }

    def holds_output(self, path: Path) -> bool:
        return under(path, list(self.writes))

    def resolve(self, raw: str, field_name: str, roots: Iterable[Path]) -> Path:
        """`raw` (relative to the data directory) with symlinks followed; it must lie under `roots`."""
        if not raw:
            raise SpecError(field_name, "empty path")
        if "\x00" in raw:
            raise SpecError(field_name, "path contains a NUL byte")
        if raw.startswith("~") and not (raw == "~" or raw.startswith("~/")):
            # the same answer whether or not that user exists: no account names are probed through paths
            raise SpecError(field_name, f"{raw[:200]!r}: '~user' paths are not accepted; give the path itself")
        try:
            candidate = Path(raw).expanduser()
            if ".." in candidate.parts:
                raise SpecError(field_name, f"{raw!r}: '..' is not allowed in paths")
            if not candidate.is_absolute():
                candidate = self.data_dir / candidate
            resolved = candidate.resolve(strict=False)  # follows every symlink that exists
        except (OSError, RuntimeError) as e:  # unknown ~user, symlink loop, name too long, no permission
            raise SpecError(field_name, f"{raw[:200]!r}: not a usable path ({_reason(e)})") from None
        if not under(resolved, list(roots)):
            raise SpecError(
                field_name,
                f"{raw!r} is outside the allowed roots (symlinks followed; the daemon's dataset_roots / output_roots)",
            )
        return resolved

    def dataset(self, raw: str, field_name: str) -> Path:
        if raw.startswith(BUILTIN_SCHEME):
            return resolve_builtin(raw, field_name, self.data_dir)
        path = self.resolve(raw, field_name, self.reads)
        try:
            exists = path.exists()
        except OSError as e:
            raise SpecError(field_name, f"dataset {raw[:200]!r} cannot be read ({_reason(e)})") from None
        if not exists:
            raise SpecError(field_name, f"dataset {raw!r} does not exist")
        return path

    def template(self, raw: str) -> Path:
        path = self.resolve(raw, "chat_template", self.reads)
        try:
            # a regular file, bounded while reading whatever its size says; never a FIFO's wait
            text = read_regular(path, MAX_TEMPLATE_BYTES, repr(raw))
            text.decode("utf-8")
        except UnsafeFile as e:
            raise SpecError("chat_template", str(e)) from None
        except UnicodeDecodeError:
            raise SpecError("chat_template", f"{raw!r} is not UTF-8 text") from None
        except OSError as e:
            raise SpecError("chat_template", f"{raw!r} cannot be read ({_reason(e)})") from None
        return path

    def output_dir(self, raw: str | None, job_id: str) -> Path:
        """The job's output directory; unset: <data_dir>/jobs/<job id>. Whether it is free is the
        manager's to say when the job is queued (another job's, or old checkpoints in it: 409)."""
        if raw is None:
            default = (self.data_dir / "jobs" / job_id).resolve()
            if not under(default, list(self.writes)):  # refused now, not FAILED when the job starts
                raise SpecError(
                    "output_dir",
                    "the default output_dir <data_dir>/jobs/<job id> is outside the daemon's output_roots; "
                    "give an output_dir under them",
                )
            return default
        path = self.resolve(raw, "output_dir", self.writes)
        if path == self.data_dir.resolve() or self.data_dir.resolve().is_relative_to(path):
            # the job store, the caches and every job's default directory live there
            raise SpecError(
                "output_dir", f"{raw!r} is the daemon's data directory or holds it; choose a directory in it"
            )
        owned = [self.data_dir.resolve() / name for name in DAEMON_DIRS]
        if under(path, owned):  # the embedded assets, the caches: a job's files there would corrupt them
            raise SpecError("output_dir", f"{raw!r} lies in a directory the daemon keeps for itself; choose another")
        try:
            not_a_dir = path.exists() and not path.is_dir()
        except OSError as e:
            raise SpecError("output_dir", f"{raw[:200]!r} cannot be used ({_reason(e)})") from None
        if not_a_dir:
            raise SpecError("output_dir", f"{raw!r} exists and is not a directory")
        _parents_are_directories(path, raw)
        return path

    def checkpoint(self, raw: str) -> Path:
        path = self.resolve(raw, "init_from", (*self.reads, *self.writes))
        try:
            is_checkpoint = (path / "config.json").is_file()
        except OSError as e:
            raise SpecError("init_from", f"{raw[:200]!r} cannot be read ({_reason(e)})") from None
        if not is_checkpoint:
            raise SpecError("init_from", f"{raw!r} is not a drafter checkpoint directory (no config.json)")
        return path


def _parents_are_directories(path: Path, raw: str) -> None:
    """The nearest of the output directory's parents that exists is a directory: a file there
    (`dflash.sqlite3/x`) would fail the job when it starts; refused now instead."""
    parent = path.parent
    try:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        a_file = not parent.is_dir()
    except OSError as e:
        raise SpecError("output_dir", f"{raw[:200]!r} cannot be used ({_reason(e)})") from None
    if a_file:
        raise SpecError("output_dir", f"{raw!r}: {parent.name!r} on its path is a file, not a directory")


def resolve_builtin(raw: str, field_name: str, data_dir: Path) -> Path:
    """builtin://train|heldout -> the embedded default's bundled dataset under data_dir."""
    name = raw[len(BUILTIN_SCHEME) :]
    if name not in BUILTIN_DATASETS:
        raise SpecError(field_name, f"unknown builtin dataset {raw!r}; use builtin://train or builtin://heldout")
    from dflash_core.defaults import ensure_default_assets

    return getattr(ensure_default_assets(data_dir), name).resolve()


def check_dataset_readable(
    path: Path, field_name: str, *, skip_bad_lines: bool, given: str, roots: Roots | None = None
) -> None:
    """The dataset's layout, schema and first records, read now: what cannot be read is refused
    at submission rather than failing the job later, naming the dataset as `given` by the client.
    roots: where each of its files must lie (those the engine reads under), checked before any
    is opened."""
    from dflash_core.data.conversations import DatasetError
    from dflash_core.data.inspect import check_dataset

    try:
        within = [Path(r) for r in roots.for_engine()["dataset_roots"]] if roots is not None else None
        check_dataset(path, skip_bad_lines=skip_bad_lines, name=given, roots=within)
    except DatasetError as e:
        raise SpecError(field_name, str(e)) from None
    except OSError as e:
        raise SpecError(field_name, f"the dataset cannot be read ({_reason(e)})") from None


def unique_datasets(resolved: list[Path]) -> None:
    """Two names for one dataset would read it twice."""
    seen: dict[Path, int] = {}
    for i, path in enumerate(resolved):
        if path in seen:
            raise SpecError(f"datasets[{i}]", f"the same dataset as datasets[{seen[path]}]")
        seen[path] = i


def given_paths(spec: Mapping[str, Any], engine_job: Any, job_id: str) -> dict[str, str]:
    """Each path of a job as the engine has it (resolved) -> as the client gave it in `spec` (the
    stored spec); the default output_dir as its documented form."""
    pairs = dict(zip(engine_job.datasets, spec.get("datasets") or [], strict=False))
    pairs.update(zip(getattr(engine_job, "sources", None) or [], spec.get("sources") or [], strict=False))
    for key in ("eval_prompts", "chat_template", "init_from", "publish_dir", "target_watch"):
        resolved, given = getattr(engine_job, key, None), spec.get(key)
        if resolved and given:
            pairs[resolved] = given
    pairs[engine_job.output_dir] = spec.get("output_dir") or f"<data_dir>/jobs/{job_id}"
    return pairs


def name_as_given(text: str, paths: Mapping[str, str]) -> str:
    """`text` with every path of `paths` (resolved -> given) that stands in it as a whole path, or
    as the directory part of one (a file found in a directory entry), named as given. Job errors
    and events are shown to whoever may read the jobs: they must not tell where the daemon's
    roots lie or where a symlink leads."""
    known = {resolved.rstrip("/") or resolved: given for resolved, given in paths.items() if resolved}
    if not known:
        return text
    alternatives = "|".join(re.escape(p) for p in sorted(known, key=len, reverse=True))
    # a path starts where no path character precedes it and ends at a separator or a non-path character
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?![\w.-])")

    def given(match: re.Match[str]) -> str:
        name = known[match.group(1)]
        # "shards/" + "/shard.jsonl": one separator
        return (name.rstrip("/") or name) if text.startswith("/", match.end()) else name

    return pattern.sub(given, text)
