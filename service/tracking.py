"""Experiment tracking of a job, as the trainers users know do it (`report_to`): TensorBoard event
files under the job's output directory (no network), and Weights & Biases or MLflow where their
package is installed (their own configuration applies: WANDB_MODE=offline, MLFLOW_TRACKING_URI,
...). One Tracker per job run; every backend gets the same scalars.

The trackers write files, so they write where the checkpoints do: into the job's output directory
opened from its root without following a symlink (dflash_core.confine.ConfinedDir) and held open,
reached through its descriptor's /proc/self/fd path. A `tensorboard` symlink planted in the
output directory, or an output directory swapped for a symlink while the job waited, is refused
(the job's `tracking` event says why), never followed out of the roots. MLflow without a tracking
URI of its own writes its file store under the output directory too, not into the current one.

The TensorBoard event file is this module's own: created fresh (`O_CREAT|O_EXCL|O_NOFOLLOW`) in
the held directory and written through its descriptor in TensorBoard's record format, so a name
planted there beforehand, a symlink included, is never written through. Libraries that open
their files by name (W&B, MLflow) get a directory this run has just created for them, where no
one else can have planted anything.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import struct
import time
import uuid
from pathlib import Path
from typing import Any

from dflash_core.confine import ConfinedDir

log = logging.getLogger("dflash.tracking")

BACKENDS = ("tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}

# the user's own MLflow server, as the daemon was started with it (read once: mlflow itself sets
# the variable when a job points it at the job's directory)
_USER_MLFLOW_URI = os.environ.get("MLFLOW_TRACKING_URI") or None


def unavailable(backends: list[str]) -> list[str]:
    """The requested backends whose package is not installed."""
    return [b for b in backends if importlib.util.find_spec(_PACKAGES[b]) is None]


def step_scalars(stats: Any) -> dict[str, float]:
    out = {
        "train/loss": stats.loss,
        "train/expected_acceptance_length": stats.expected_acceptance_length,
        "train/learning_rate": stats.learning_rate,
        "train/grad_norm": stats.grad_norm,
        "train/tokens_per_second": stats.tokens_per_second,
        "train/step_seconds": stats.step_seconds,
        "train/epoch": stats.epoch,
    }
    for position, accuracy in enumerate(stats.position_accuracy, start=1):
        out[f"train/accuracy/position_{position:02d}"] = accuracy
    return {k: float(v) for k, v in out.items() if v is not None}


class Tracker:
    def __init__(
        self,
        backends: list[str],
        *,
        job_id: str,
        name: str | None,
        output_dir: str,
        spec: dict[str, Any],
        roots: list[str] | list[Path] | None = None,
    ):
        """roots: the output roots the job's directories must stay under (None or empty: unconfined,
        for a caller outside the daemon)."""
        self._writers: list[Any] = []
        self._dirs: list[ConfinedDir] = []
        self.errors: list[dict[str, str]] = []  # {backend, error} of each backend not started
        self.directory = Path(output_dir) / "tensorboard"
        for backend in backends:
            try:
                self._writers.append(self._open(backend, job_id, name, output_dir, spec, list(roots or [])))
            except Exception as e:  # noqa: BLE001 - tracking must never stop a job
                log.warning("report_to %s: not started (%s)", backend, e, extra={"fields": {"job": job_id}})
                self.errors.append({"backend": backend, "error": str(e)})

    def _confined(self, path: Path, roots: list[Any]) -> ConfinedDir:
        """`path` opened without following a symlink below its root, held open until close()."""
        directory = ConfinedDir(path, roots, "output_dir")
        self._dirs.append(directory)
        return directory

    def _private(self, path: Path, prefix: str, roots: list[Any]) -> str:
        """A directory created now under `path` for a library that opens its files by name; the
        path of its descriptor, which a later swap of a component cannot redirect."""
        _, directory = self._confined(path, roots).mkdir_fresh(prefix, 0o755)
        self._dirs.append(directory)
        return f"/proc/self/fd/{directory.fd}"

    def _open(self, backend: str, job_id: str, name: str | None, output_dir: str, spec: dict[str, Any], roots):
        if backend == "tensorboard":
            return _TensorBoard(self._confined(self.directory, roots))
        if backend == "wandb":
            return _Wandb(job_id, name, self._private(Path(output_dir), "wandb-", roots), spec)
        if backend == "mlflow":
            uri = None if _USER_MLFLOW_URI else "file://" + self._private(Path(output_dir), "mlruns-", roots)
            return _MLflow(job_id, name, spec, uri)
        raise ValueError(f"unknown report_to backend {backend!r}")

    def step(self, stats: Any) -> None:
        self._log(step_scalars(stats), stats.step)

    def eval(self, step: int, result: dict[str, Any]) -> None:
        tau = result.get("acceptance_length")
        if tau is not None:
            self._log({"eval/acceptance_length": float(tau)}, step)

    def checkpoint(self, step: int, pause_seconds: float) -> None:
        self._log({"checkpoint/pause_seconds": float(pause_seconds)}, step)

    def _log(self, scalars: dict[str, float], step: int) -> None:
        for writer in self._writers:
            try:
                writer(scalars, step)
            except Exception as e:  # noqa: BLE001 - tracking must never stop a job
                log.warning("experiment tracking failed: %s", e)

    def close(self) -> None:
        for writer in self._writers:
            close = getattr(writer, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:  # noqa: BLE001 - tracking must never stop a job
                    log.warning("closing experiment tracking failed: %s", e)
        self._writers = []
        for directory in self._dirs:
            directory.close()
        self._dirs = []


class _TensorBoard:
    """An event file of its own in `directory`, one record per call, flushed as it is written
    (what a killed run leaves is readable up to its last step)."""

    def __init__(self, directory: ConfinedDir):
        from tensorboardX.proto import event_pb2, summary_pb2
        from tensorboardX.record_writer import masked_crc32c

        self._event, self._summary, self._crc = event_pb2.Event, summary_pb2.Summary, masked_crc32c
        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        while True:  # TensorBoard reads any file whose name holds "tfevents"
            try:
                fd = directory.create(f"{stem}.{uuid.uuid4().hex[:8]}")
                break
            except FileExistsError:
                continue
        self._file = os.fdopen(fd, "wb")
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data)))
        self._file.flush()

    def __call__(self, scalars: dict[str, float], step: int) -> None:
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))

    def close(self) -> None:
        try:
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


class _Wandb:
    def __init__(self, job_id: str, name: str | None, output_dir: str, spec: dict[str, Any]):
        import wandb

        self._run = wandb.init(name=name or job_id, id=job_id, resume="allow", dir=output_dir, config=spec)

    def __call__(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _MLflow:
    def __init__(self, job_id: str, name: str | None, spec: dict[str, Any], tracking_uri: str | None):
        import mlflow

        self._mlflow = mlflow
        if tracking_uri is not None:  # its default is ./mlruns: the current directory, outside the roots
            mlflow.set_tracking_uri(tracking_uri)
            # mlflow exports the URI to the environment: the next job must not read this one's
            if _USER_MLFLOW_URI is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = _USER_MLFLOW_URI
        self._run = mlflow.start_run(run_name=name or job_id, tags={"dflash.job_id": job_id})
        mlflow.log_params({k: str(v)[:500] for k, v in spec.items()})

    def __call__(self, scalars: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()
