"""``python -m roundpipe.demo --fused [--dtype bfloat16]`` (roundpipe/demo_fused.py): roundpipe's
AdamW(fused=True) against torch's, bit for bit every step; a difference is named."""

import types

import pytest

from roundpipe import demo, demo_fused
from roundpipe import optim as rp_optim


@pytest.mark.parametrize("dtype", [[], ["--dtype", "bfloat16"]], ids=["float32", "bfloat16"])
def test_demo_fused_runs_bitwise(capsys, dtype):
    assert demo.main(["--small", "--steps", "3", "--fused", *dtype]) == 0
    text = capsys.readouterr().out
    kind = "bfloat16" if dtype else "float32"
    assert f"a {kind} model, AdamW(fused=True) on both sides" in text
    assert "step | loss roundpipe fused | loss torch fused" in text
    assert "speedup of roundpipe AdamW(fused=True) over torch's: " in text
    assert "every one of the 3 steps bitwise equal to torch's fused step (parameters, state)" in text


def test_demo_fused_names_a_difference(capsys, monkeypatch):
    """A roundpipe step that is not torch's (its lr off) is caught at the first step."""
    other = types.SimpleNamespace(
        AdamW=lambda params, **kw: rp_optim.AdamW(params, **{**kw, "lr": kw["lr"] * 1.5})
    )
    monkeypatch.setattr(demo_fused, "rp_optim", other)
    assert demo.main(["--small", "--steps", "2", "--fused"]) == 1
    assert "MISMATCH: roundpipe's fused step first differs from torch's at step 0" in capsys.readouterr().out


def test_demo_fused_refuses_other_demos(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--small", "--fused", "--state-dtype", "bfloat16"])
    assert "--fused trains AdamW(fused=True)" in capsys.readouterr().err
