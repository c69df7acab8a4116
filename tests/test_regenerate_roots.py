"""A regeneration reads its prompts only from files under the dataset roots: a symlinked file in
a dataset directory, or a regeneration manifest naming a shard elsewhere, is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.confine import OutsideRoots
from dflash_core.data.conversations import DatasetError
from dflash_core.data.prompts import read_prompts
from dflash_core.data.regenerated import FORMAT, MANIFEST
from dflash_core.data.sources import dataset_files


def _prompt_line(text: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"


@pytest.fixture()
def roots(tmp_path):
    inside, outside = tmp_path / "data", tmp_path / "secret"
    inside.mkdir()
    outside.mkdir()
    (outside / "s.jsonl").write_text(_prompt_line("a secret prompt"))
    return inside, outside


def test_a_symlinked_file_in_a_dataset_directory_is_refused(roots):
    inside, outside = roots
    ds = inside / "ds"
    ds.mkdir()
    (ds / "a.jsonl").write_text(_prompt_line("an allowed prompt"))
    (ds / "b.jsonl").symlink_to(outside / "s.jsonl")
    with pytest.raises(OutsideRoots, match=r"b\.jsonl"):
        list(read_prompts(ds, name="ds", roots=[inside]))
    (ds / "b.jsonl").unlink()
    assert [p.messages[-1]["content"] for p in read_prompts(ds, name="ds", roots=[inside])] == ["an allowed prompt"]


@pytest.mark.parametrize("file", ["SECRET", "../secret/x.parquet", "sub/x.parquet", ".."])
def test_a_manifest_names_only_shards_beside_it(roots, file):
    inside, outside = roots
    out = inside / "regen"
    out.mkdir()
    table = pa.table({"messages": [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]})
    pq.write_table(table, outside / "x.parquet")
    name = str(outside / "x.parquet") if file == "SECRET" else file
    manifest = {"format": FORMAT, "shards": [{"index": 0, "file": name}]}
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="not a file name in this directory"):
        dataset_files(out, "regen")


def test_a_planted_manifest_is_read_only_as_a_bounded_regular_file(tmp_path):
    """A FIFO, a symlink or a huge file planted as the manifest is refused at once, naming it as
    the dataset was named: the reader never waits on a FIFO nor holds a huge file in memory."""
    import os
    import threading

    from dflash_core.data.regenerated import MANIFEST_LIMIT

    (tmp_path / "secret.json").write_text(json.dumps({"format": FORMAT, "shards": [], "secret": 1}))
    cases = {
        "fifo": lambda p: os.mkfifo(p),
        "link": lambda p: p.symlink_to(tmp_path / "secret.json"),
        "huge": lambda p: _sparse(p, MANIFEST_LIMIT + 1),
    }
    for case, plant in cases.items():
        out = tmp_path / case
        out.mkdir()
        plant(out / MANIFEST)
        failure: list[BaseException] = []

        def read(out=out, failure=failure, case=case):
            try:
                dataset_files(out, f"given-{case}")
            except BaseException as e:  # noqa: BLE001 - the test checks which
                failure.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        if reader.is_alive():
            with open(out / MANIFEST, "wb"):  # let the waiting reader go
                pass
            raise AssertionError(f"{case}: the reader waited on the manifest")
        assert failure and isinstance(failure[0], DatasetError), (case, failure)
        message = str(failure[0])
        assert f"given-{case}/{MANIFEST}" in message and "secret" not in message, message


def test_a_chat_template_replaced_by_a_fifo_is_refused_at_once(tmp_path):
    """The template a job reads when it runs may have been replaced since submission: a FIFO is
    refused without waiting on it, a file grown past the bound is refused too."""
    import os
    import threading

    from dflash_core.engine import JobError
    from dflash_core.engine.config import MAX_TEMPLATE_BYTES, TrainJob, job_template

    template = tmp_path / "template.jinja"
    os.mkfifo(template)
    job = TrainJob(
        datasets=[], output_dir=str(tmp_path / "out"), chat_template=str(template), dataset_roots=[str(tmp_path)]
    )
    failure: list[BaseException] = []

    def read():
        try:
            job_template(job)
        except BaseException as e:  # noqa: BLE001 - the test checks which
            failure.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with open(template, "wb"):  # let the waiting reader go
            pass
        raise AssertionError("the job waited on a FIFO chat template")
    assert failure and isinstance(failure[0], JobError) and "regular file" in str(failure[0]), failure
    template.unlink()
    template.write_bytes(b"x" * (MAX_TEMPLATE_BYTES + 1))
    with pytest.raises(JobError, match="chat_template"):
        job_template(job)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_a_dataset_file_replaced_by_a_fifo_is_refused_at_once(tmp_path, suffix):
    """A dataset file listed, then replaced by a FIFO before it is read, is refused without
    waiting for a writer, naming the file."""
    import os
    import threading

    from dflash_core.data.sources import iter_records

    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / f"a{suffix}").write_text(_prompt_line("hi"))
    (src,) = dataset_files(ds, "given")
    (ds / f"a{suffix}").unlink()
    os.mkfifo(ds / f"a{suffix}")
    failure: list[BaseException] = []

    def read():
        try:
            list(iter_records(src))
        except BaseException as e:  # noqa: BLE001 - the test checks which
            failure.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with open(ds / f"a{suffix}", "wb"):  # let the waiting reader go
            pass
        raise AssertionError("the reader waited on a FIFO")
    assert failure and isinstance(failure[0], DatasetError), failure
    assert f"given/a{suffix}" in str(failure[0]) and "not a regular file" in str(failure[0]), failure


def test_content_digests_never_wait_on_a_fifo(tmp_path):
    """What names a dataset file's content (the tokenization cache key, a regeneration's plan)
    reads it as a regular file: a FIFO in its place is refused at once."""
    import os
    import threading

    from dflash_core.confine import UnsafeFile
    from dflash_core.data.cache_entry import file_digest

    fifo = tmp_path / "a.jsonl"
    os.mkfifo(fifo)
    failure: list[BaseException] = []

    def digest():
        try:
            file_digest(fifo)
        except BaseException as e:  # noqa: BLE001 - the test checks which
            failure.append(e)

    reader = threading.Thread(target=digest, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with open(fifo, "wb"):  # let the waiting reader go
            pass
        raise AssertionError("the digest waited on a FIFO")
    assert failure and isinstance(failure[0], UnsafeFile), failure


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def test_the_writer_refuses_a_manifest_no_reader_would_take(tmp_path, monkeypatch):
    """A regeneration whose manifest would outgrow what readers take fails naming it, its
    complete shards and the manifest that lists them left readable, instead of writing an
    output that nothing can train on or resume."""
    from dflash_core.data import regenerated
    from dflash_core.engine.api import JobError
    from dflash_core.regenerate import output

    monkeypatch.setattr(output, "MANIFEST_LIMIT", 1200)
    monkeypatch.setattr(regenerated, "MANIFEST_LIMIT", 1200)
    row = {"messages": [{"role": "user", "content": "hi"}], "source": "p.jsonl:1", "sample": 0}
    row.update(prompt_tokens=1, completion_tokens=1, finish_reason="stop")
    out = output.ShardOutput(str(tmp_path / "out"), [str(tmp_path)])
    out.start({"plan": 1})
    written = 0
    with pytest.raises(JobError, match=r"regeneration\.json would hold \d+ shards, more than a reader takes"):
        for i in range(100):
            out.write_shard(i, [row])
            written += 1
    out.close()
    assert 0 < written < 100
    assert len(regenerated.read_manifest(tmp_path / "out")["shards"]) == written
