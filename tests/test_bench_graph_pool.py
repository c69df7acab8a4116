"""bench/graph_pool.py's arguments, refused before any GPU work (the bench itself needs CUDA)."""

import pytest
import torch

from bench.graph_pool import main


@pytest.mark.parametrize("flag", ["--layers", "--slots", "--ride", "--length"])
def test_a_count_below_one_is_refused(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main([flag, "0"])
    assert e.value.code == 2
    assert "take positive counts" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_without_cuda_it_says_so(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
