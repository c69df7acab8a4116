"""Errors say what is wrong without giving away more: a refused pickle names what it needs but
does not repeat torch's advice to load it unsafely; a dataset error does not echo a record's
value; a `~user` path gets the same answer whether or not the account exists; sizes in a
disk-full refusal are readable for small checkpoints too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_core.checkpoint import TRAINING_STATE_FILE, UnsafeTrainingState, load_training_state
from dflash_core.data.conversations import DatasetError, parse_conversation
from dflash_core.engine.checkpointing import human_bytes
from service.jobs.paths import Roots
from service.jobs.schemas import SpecError


class Planted:
    def __reduce__(self):
        return (print, ("planted",))


def test_a_refused_pickle_does_not_advise_loading_it_unsafely(tmp_path):
    ckpt = tmp_path / "step-00000001"
    ckpt.mkdir()
    torch.save({"step": 1, "payload": Planted()}, ckpt / TRAINING_STATE_FILE)
    with pytest.raises(UnsafeTrainingState) as e:
        load_training_state(ckpt)
    message = str(e.value)
    assert "weights_only" not in message and "arbitrary code" not in message, message
    assert "it needs print" in message and "\x1b" not in message and "not loaded" in message, message


def test_a_dataset_error_does_not_echo_the_record():
    record = {"messages": [{"role": "SECRET-TOKEN-1234", "content": "x"}, {"role": "assistant", "content": "y"}]}
    with pytest.raises(DatasetError) as e:
        parse_conversation(record, "given.jsonl", 7)
    assert "SECRET-TOKEN-1234" not in str(e.value) and "given.jsonl:7" in str(e.value), e.value


def test_tilde_user_paths_get_one_answer_whether_or_not_the_user_exists(tmp_path):
    answers = []
    for user in ("root", "nosuchuserxyz"):  # root exists everywhere, the other nowhere
        with pytest.raises(SpecError) as e:
            Roots(tmp_path, (tmp_path,), ()).dataset(f"~{user}/x.jsonl", "datasets[0]")
        answers.append(e.value.message.replace(user, "USER"))
    assert answers[0] == answers[1] and "'~user' paths are not accepted" in answers[0], answers
    assert str(Path.home()) not in answers[0]


def test_sizes_are_readable_at_every_scale():
    assert human_bytes(300) == "300 bytes"
    assert human_bytes(3 << 20) == "3.0 MiB"
    assert human_bytes(int(1.5 * 2**30)) == "1.5 GiB"
    assert human_bytes(5 << 40) == "5120.0 GiB"
