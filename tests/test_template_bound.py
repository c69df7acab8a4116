"""A chat template that loops for hours is refused at admission within a few seconds, naming the
field, instead of holding the submission (and a CPU core) until the daemon stops: the admission
checks render through ChatTemplate.probe, bounded in time in the rendering thread alone."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest

from dflash_core.data import tokenize
from dflash_core.data.tokenize import ChatTemplate, RenderTooSlow
from dflash_core.engine.admission import check_template
from dflash_core.engine.api import JobError
from dflash_core.engine.config import TrainJob

# about half a minute unbounded (a regression fails the tests, rather than hanging them); the
# same loop over range(100000) takes hours
SLOW = "{% for i in range(30000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}hi"
SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
TURN = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]


def test_a_looping_template_stops_at_the_bound(tokenizer):
    began = time.monotonic()
    with pytest.raises(RenderTooSlow, match=r"more than 0\.3 s"):
        ChatTemplate.of(SLOW).probe(tokenizer, TURN, False, seconds=0.3)
    assert time.monotonic() - began < 5
    template = ChatTemplate.of(SIMPLE)
    assert template.probe(tokenizer, TURN, True, seconds=0.3) == template.render(tokenizer, TURN, True)


def test_the_threads_own_trace_function_is_put_back_and_others_are_untouched(tokenizer):
    def mine(frame, event, arg):
        return None

    other: list = []
    thread = threading.Thread(target=lambda: other.append(sys.gettrace()))
    sys.settrace(mine)
    try:
        with pytest.raises(RenderTooSlow), tokenize.time_bound(0.05, "x"):
            thread.start()
            thread.join()
            ChatTemplate.of(SLOW).render(tokenizer, TURN, False)
        assert sys.gettrace() is mine
    finally:
        sys.settrace(None)
    assert other == [None]


def _refused_at_admission(template: str, tokenizer, tmp_path) -> JobError:
    """The training admission's template check of a job with this template file; its refusal."""
    (tmp_path / "t.jinja").write_text(template)
    job = TrainJob(
        datasets=["x"], output_dir=str(tmp_path / "out"), chat_template=str(tmp_path / "t.jinja"),
        dataset_roots=[str(tmp_path)],
    )  # fmt: skip
    with pytest.raises(JobError) as e:
        check_template(job, SimpleNamespace(tokenizer=tokenizer))
    return e.value


def test_admission_refuses_it_naming_the_field(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize, "PROBE_SECONDS", 0.3)
    e = _refused_at_admission(SLOW, tokenizer, tmp_path)
    assert e.field == "chat_template" and "RenderTooSlow" in str(e)


def test_a_template_that_writes_an_unpaired_surrogate_is_refused(tokenizer, tmp_path):
    e = _refused_at_admission("{{ '\\ud800' }}{% for m in messages %}{{ m.content }}{% endfor %}", tokenizer, tmp_path)
    assert e.field == "chat_template" and "UnicodeEncodeError" in str(e)
