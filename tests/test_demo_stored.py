"""``python -m roundpipe.demo --state-dtype bfloat16`` and ``--dtype bfloat16
[--stochastic-rounding]`` (roundpipe/demo_stored.py)."""

import pytest

from roundpipe import demo, demo_stored


def test_demo_state_dtype_runs_bitwise(capsys):
    assert demo.main(["--small", "--steps", "3", "--state-dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "step | loss roundpipe bf16 state | loss roundpipe fp32 state | loss torch fused fp32" in text
    assert "roundpipe bf16 state: step " in text and "; state 4.00 bytes a parameter" in text
    assert "roundpipe fp32 state: step " in text and "; state 8.00 bytes a parameter" in text
    assert "roundpipe bf16 state: a step is bitwise equal to its composition with torch's for-loop" in text
    assert "roundpipe fp32 state: a step is bitwise equal to torch's for-loop" in text


def test_demo_pure_bfloat16_with_stochastic_rounding(capsys):
    assert demo.main(["--small", "--steps", "3", "--dtype", "bfloat16", "--stochastic-rounding"]) == 0
    text = capsys.readouterr().out
    assert "step | loss roundpipe bf16 SR | loss roundpipe bf16 nearest | loss torch fused fp32" in text
    assert "measured here: stochastic rounding kept the bfloat16 model " in text
    assert "roundpipe bf16 SR: a step is bitwise equal to its composition with torch's for-loop" in text
    assert "roundpipe bf16 nearest: a step is bitwise equal to torch's for-loop on the bfloat16 model" in text


def test_demo_stored_reports_a_mismatch(capsys, monkeypatch):
    """A stochastic rounding that is not the optimizer's is named, and the exit status is 1."""
    monkeypatch.setattr(demo_stored, "stochastic_round", lambda x, seed, steps, pid: x.bfloat16() * 0)
    assert demo.main(["--small", "--steps", "2", "--dtype", "bfloat16", "--stochastic-rounding"]) == 1
    assert "MISMATCH: roundpipe bf16 SR: a step differs from" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--stochastic-rounding"],
        ["--state-dtype", "bfloat16", "--stochastic-rounding"],
        ["--state-dtype", "bfloat16", "--dtype", "bfloat16"],
        ["--dtype", "bfloat16", "--mixed", "bfloat16"],
        ["--dtype", "bfloat16", "--optimizer", "Adafactor"],
        ["--state-dtype", "bfloat16", "--compute", "float32"],
    ],
)
def test_demo_stored_refuses_what_it_does_not_run(argv):
    with pytest.raises(SystemExit):
        demo.parse_args(["--small", "--steps", "1", *argv])
