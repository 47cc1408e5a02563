"""``--dtype`` and ``--state-dtype`` (``bench/stored.py``): the tables, the checks against the
ground truth (and that they can fail), the state bytes, the JSON rows and the refused arguments."""

import json
import re

import pytest
import torch

from roundpipe.optim import bench, fused_kernels
from roundpipe.optim.bench import cli, stored


def _tiny(monkeypatch, shapes=((3,), (100,), (0,), (5, 7))):
    tiny = bench.Workload("small", f"{len(shapes)} tensors", tuple(shapes))
    monkeypatch.setattr(cli, "workload_parts", lambda name, quick: [tiny])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_mode(tmp_path, capsys, monkeypatch, dtype):
    """16-bit parameters: roundpipe, torch's for-loop (the ground truth) and torch fused, named
    as another result; Adamax has no fused kernel."""
    _tiny(monkeypatch)
    out = tmp_path / "dtype.json"
    argv = f"--quick --optimizers Adam,Adamax --workloads small --dtype {dtype} --repeats 1 --json {out}"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert f"benchmark (quick, --dtype {dtype})" in text
    assert f"{dtype} parameters, gradients and state, stepped as they are" in text
    assert "torch fused computes in float32 and rounds once: another result" in text
    assert re.search(r"optimizer \| roundpipe \| torch for-loop \| torch fused \(fp32, 1 rounding\) \|", text)
    assert "\n  Adam: equal; torch fused differs from the for-loop in " in text
    assert "\n  Adamax: equal\n" in text and "MISMATCH" not in text and "FAILURES" not in text
    rows = json.loads(out.read_text())["workloads"]["small"]["optimizers"]
    adam, adamax = rows["Adam"], rows["Adamax"]
    assert list(adam["median_ms"]) == ["roundpipe", "torch for-loop", "torch fused (fp32, 1 rounding)"]
    assert list(adamax["median_ms"]) == ["roundpipe", "torch for-loop"]
    assert adam["bit_for_bit"] is True and adam["bytes_per_element"] == 14  # 7 tensors at 2 bytes
    state = adam["state_bytes_per_element_by_config"]
    assert state["roundpipe"] == pytest.approx(4 + 4 * 4 / 138)  # two moments, four 0-d steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_mode(tmp_path, capsys, monkeypatch, dtype):
    """``--fused``: roundpipe's fused=True against torch's, checked first; a torch kernel known
    wrong (2.13's 16-bit SGD) is timed and marked, not checked; the check can fail."""
    _tiny(monkeypatch)
    out = tmp_path / "fused.json"
    argv = f"--quick --optimizers AdamW,SGD --workloads small --fused {dtype} --repeats 1 --json {out}"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert f"fused=True on {dtype} parameters" in text
    assert re.search(r"optimizer \| roundpipe fused=True \| torch fused=True \| vs torch fused=True \|", text)
    assert "\n  AdamW: equal\n" in text
    wrong = fused_kernels.known_wrong("SGD", stored.FUSED_DTYPES[dtype])
    assert (f"\n  SGD: {stored.NOT_CHECKED}: torch " in text) == wrong
    rows = json.loads(out.read_text())["workloads"]["small"]["optimizers"]
    assert rows["AdamW"]["configs"] == ["roundpipe fused=True", "torch fused=True"]
    assert rows["AdamW"]["bit_for_bit"] is True
    # the check can fail: a roundpipe step that is not the kernel's
    real = stored.make

    def other(mode, dtype_, config, name, params, grads):
        opt = real(mode, dtype_, config, name, params, grads)
        if config == stored.RP_FUSED:
            for g in opt.param_groups:
                g["lr"] *= 1.5
        return opt

    monkeypatch.setattr(stored, "make", other)
    assert (
        bench.main(f"--quick --optimizers AdamW --workloads small --fused {dtype} --repeats 1".split()) == 1
    )
    assert "MISMATCH" in capsys.readouterr().out


def test_fused_mode_refuses_an_optimizer_without_a_kernel(capsys):
    with pytest.raises(SystemExit):
        bench.main("--fused --optimizers Adamax".split())
    assert "--fused times the optimizers torch has a fused CPU kernel for" in capsys.readouterr().err


def test_state_dtype_mode(tmp_path, capsys, monkeypatch):
    """fp32 parameters with bfloat16 state against fp32 state and torch's fused fp32 step (its
    for-loop where it has no fused kernel), the state bytes halved."""
    _tiny(monkeypatch)
    out = tmp_path / "state.json"
    argv = "--quick --optimizers AdamW,RMSprop --workloads small --state-dtype bfloat16 --repeats 1"
    argv += f" --json {out}"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert "fp32 parameters and gradients, bfloat16 state (state_dtype=torch.bfloat16)" in text
    assert re.search(r"optimizer \| roundpipe bfloat16 state \| roundpipe fp32 state \| +torch fp32 \|", text)
    assert " (fused) |" in text and " (for-loop) |" in text
    assert "the composition with torch's for-loop after 2 steps:\n  AdamW: equal\n  RMSprop: equal" in text
    rows = json.loads(out.read_text())["workloads"]["small"]["optimizers"]
    adamw = rows["AdamW"]
    assert adamw["configs"] == ["roundpipe bfloat16 state", "roundpipe fp32 state", "torch fused fp32"]
    assert rows["RMSprop"]["configs"][2] == "torch for-loop fp32"
    state = adamw["state_bytes_per_element_by_config"]
    steps = 4 * 4 / 138  # four 0-d float32 steps over 138 elements
    assert state["roundpipe bfloat16 state"] == pytest.approx(4 + steps)
    assert state["roundpipe fp32 state"] == state["torch fused fp32"] == pytest.approx(8 + steps)
    # param, grad at 4; exp_avg, exp_avg_sq read and written at 2: 4 + 4 + 4 + 8 (the 20)
    assert adamw["bytes_per_element"] == 20


def test_the_checks_can_fail(monkeypatch):
    params, grads = [torch.randn(3), torch.randn(2, 5)], [torch.randn(3), torch.randn(2, 5)]
    for mode in ("dtype", "state_dtype"):
        assert stored.check(mode, torch.bfloat16, "bfloat16", "Adam", params, grads, True)[0] is None
    real = stored.make

    def one_off(mode, dtype, config, name, base_params, base_grads):
        opt = real(mode, dtype, config, name, base_params, base_grads)
        if config.startswith("roundpipe"):
            step = opt.step

            def stepped():
                step()
                p = opt.param_groups[0]["params"][1]
                view = p.data.view(-1).view(torch.int16 if p.dtype is not torch.float32 else torch.int32)
                view[-1] += 1

            opt.step = stepped
        return opt

    monkeypatch.setattr(stored, "make", one_off)
    for mode in ("dtype", "state_dtype"):
        verdict = stored.check(mode, torch.bfloat16, "bfloat16", "Adam", params, grads, True)[0]
        assert verdict.startswith("AssertionError: param 1: 1 of 10 elements differ"), verdict


@pytest.mark.parametrize(
    "bad",
    [
        "--dtype int8",
        "--dtype bfloat16 --state-dtype bfloat16",
        "--dtype bfloat16 --partners",
        "--state-dtype bfloat16 --first-use",
        "--dtype bfloat16 --workloads per_param",
        "--state-dtype float16 --backends reference",
        "--dtype bfloat16 --optimizers Adafactor",
        "--dtype bfloat16 --optimizers AdamW8bit",
    ],
)
def test_refused_arguments(bad):
    with pytest.raises(SystemExit):
        cli.parse_args(bad.split())


def test_defaults():
    args = cli.parse_args(["--state-dtype", "bfloat16"])
    assert args.workloads == list(stored.WORKLOADS) and "Adafactor" not in args.optimizers
    assert cli.parse_args([]).dtype is None and cli.parse_args([]).state_dtype is None
