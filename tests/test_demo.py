"""The demo (``roundpipe/demo.py``) still runs (a tiny configuration; no timings are asserted).

It is never given ``--threads``: that would set numexpr's thread count for the tests after these.
"""

import copy
import sys

import pytest
import torch

from roundpipe import demo, demo_eightbit, demo_mixed
from roundpipe.optim import backends as rp_backends
from roundpipe.optim import bench


def test_demo_model():
    vocab, d, layers, heads, context, _ = demo.SIZES["small"]
    model = demo.build_model("small")
    assert model.tok.weight.shape == (vocab, d) and len(model.blocks) == layers
    with pytest.raises(ValueError, match="unknown model size"):
        demo.build_model("huge")
    kinds = demo.optimizer_kinds(None, ["native", "fast", "fast:torch"])
    assert list(kinds) == [
        "roundpipe fast",
        demo.FUSED,
        demo.LOOP,
        "roundpipe fast:numba",  # native's new name
        "roundpipe fast:torch",
    ]


def test_demo_runs(capsys):
    assert demo.main(["--small", "--steps", "2", "--compare", "fast:numexpr"]) == 0
    text = capsys.readouterr().out
    assert f"roundpipe's default backend: {bench.fast_engine()['text']}" in text
    assert (
        "step | loss roundpipe fast | loss torch fused | loss torch for-loop | loss roundpipe fast:numexpr"
        in text
    )
    label = demo.engine_label("fast")
    assert label == f"fast: {rp_backends.get('fast').engine()} engine"
    assert f"speedup of roundpipe ({label}) over torch fused AdamW: " in text
    assert "speedup of roundpipe (fast:numexpr) over torch fused AdamW: " in text
    assert "(over torch's default for-loop: " in text
    if rp_backends.get("fast").exact:
        assert (
            "roundpipe fast: a step is bitwise equal to torch's for-loop step (parameters and state)" in text
        )
    assert "roundpipe fast:numexpr: a step is" in text
    with pytest.raises(SystemExit):
        demo.main(["--small", "--steps", "1", "--compare", "bogus"])


def test_demo_trains_with_adafactor(capsys):
    """--optimizer Adafactor: roundpipe's against torch's foreach (torch has no fused Adafactor)
    and for-loop, with the speedups and the one-step match as for AdamW."""
    kinds = demo.optimizer_kinds(None, ["fast:torch"], "Adafactor")
    assert list(kinds) == ["roundpipe fast", demo.FOREACH, demo.LOOP, "roundpipe fast:torch"]
    assert demo.main(["--small", "--steps", "2", "--optimizer", "Adafactor"]) == 0
    text = capsys.readouterr().out
    assert "steps of Adafactor(lr=0.01, weight_decay=0.1) per copy" in text
    assert "step | loss roundpipe fast | loss torch foreach | loss torch for-loop" in text
    assert "roundpipe fast Adafactor" in text and "vs foreach" in text
    label = demo.engine_label("fast")
    assert f"speedup of roundpipe ({label}) over torch foreach Adafactor: " in text
    assert "(over torch's default for-loop: " in text
    if rp_backends.get("fast").exact:
        assert (
            "roundpipe fast: a step is bitwise equal to torch's for-loop step (parameters and state)" in text
        )
    with pytest.raises(SystemExit):
        demo.main(["--small", "--steps", "1", "--optimizer", "Adafactor", "--mixed", "bfloat16"])
    with pytest.raises(ValueError, match="unknown optimizer"):
        demo.optimizer_kinds(None, (), "Lion")


@pytest.mark.parametrize("compute", ["16-bit", "float32"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_demo_mixed_precision_runs_bitwise(capsys, dtype, compute):
    """--mixed: the model in low precision with fp32 masters, (loss scaling and) clipping, next
    to the same loop with torch.optim and casts; roundpipe's model ends bitwise equal to the
    for-loop composition's (the exit status says so too), with the forward and backward in the
    16-bit dtype or in float32 from the 16-bit parameters."""
    assert demo.main(["--small", "--steps", "4", "--mixed", dtype, "--compute", compute]) == 0
    out = capsys.readouterr().out
    assert f"every parameter in {dtype}, fp32 masters" in out
    how = dtype if compute == "16-bit" else f"float32, from float32 copies of the {dtype} parameters"
    assert f"forward and backward: {how}" in out
    assert f"why: --compute {compute}" in out
    assert "speedup of roundpipe's optimizer phase over torch fused's" in out
    assert "the model is bitwise equal to the for-loop composition's" in out
    assert "roundpipe's clip norms against torch's get_total_norm of the same gradients" in out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_float32_compute_leaves_16_bit_gradients(dtype):
    """Forward and backward in float32 still leave every parameter (a partner) and its gradient
    in the 16-bit dtype, the gradients those of the float32 arithmetic rounded once."""
    model = demo.build_model("small").to(dtype)
    wide = copy.deepcopy(model).float()
    data = torch.randint(0, demo.SIZES["small"][0], (2, demo.SIZES["small"][4] + 1))

    class Runner:
        scaler, loss = None, None

        def phase(self):
            pass

    demo_mixed.train_step(model, Runner(), data, torch.arange(2), widen=True)
    x, y = data[:, :-1], data[:, 1:]
    torch.nn.functional.cross_entropy(wide(x).flatten(0, 1), y.flatten()).backward()
    for p, q in zip(model.parameters(), wide.parameters(), strict=True):
        assert p.dtype == p.grad.dtype == dtype
        assert torch.equal(p.grad, q.grad.to(dtype))


@pytest.mark.parametrize("ratio", [0.5, 30.0])
def test_mixed_compute_auto_follows_the_matmul_timing(monkeypatch, ratio):
    """auto computes in float32 exactly where a 16-bit matmul is over SLOW_RATIO times slower,
    and the header says what it measured; --compute forces either without timing."""
    monkeypatch.setattr(demo_mixed, "matmul_slowdown", lambda dtype: ratio)
    widen, lines = demo_mixed.choose_compute(torch.float16, "auto")
    assert widen == (ratio > demo_mixed.SLOW_RATIO)
    assert f"a float16 matmul took {ratio:.1f}x float32's time on one core here" in lines
    assert ("--compute 16-bit forces float16" in lines) == widen
    monkeypatch.setattr(demo_mixed, "matmul_slowdown", None)  # forced: never timed
    assert demo_mixed.choose_compute(torch.float16, "16-bit")[0] is False
    assert demo_mixed.choose_compute(torch.float16, "float32")[0] is True


def test_matmul_slowdown_measures_and_restores_threads():
    threads = torch.get_num_threads()
    assert demo_mixed.matmul_slowdown(torch.bfloat16, rows=8, width=16, reps=2) > 0
    assert torch.get_num_threads() == threads


def test_demo_compute_needs_mixed():
    with pytest.raises(SystemExit):
        demo.main(["--small", "--steps", "1", "--compute", "float32"])


def _bnb_importable() -> bool:
    return demo_eightbit.bitsandbytes_optim() is not None


def test_demo_adamw8bit_defaults_and_copies():
    """--optimizer AdamW8bit: 30 steps by default, as the others; its copies: roundpipe's,
    torch's fused fp32 AdamW, bitsandbytes' where importable, then each --compare backend."""
    assert demo.parse_args(["--optimizer", "AdamW8bit"])[0].steps == 30
    assert demo.parse_args([])[0].steps == 30
    kinds = demo.optimizer_kinds(None, ["fast:torch"], "AdamW8bit")
    bnb = [demo_eightbit.BNB] if _bnb_importable() else []
    assert list(kinds) == ["roundpipe fast", demo.FUSED, *bnb, "roundpipe fast:torch"]
    with pytest.raises(SystemExit):
        demo.main(["--small", "--steps", "1", "--optimizer", "AdamW8bit", "--mixed", "bfloat16"])


@pytest.mark.skipif(not _bnb_importable(), reason="bitsandbytes cannot be imported here")
def test_demo_adamw8bit_is_bitsandbytes_bit_for_bit(capsys):
    assert demo.main(["--small", "--steps", "2", "--optimizer", "AdamW8bit", "--compare", "reference"]) == 0
    text = capsys.readouterr().out
    assert "steps of AdamW8bit(lr=0.001, betas=(0.9, 0.95), weight_decay=0.1) per copy" in text
    assert (
        "step | loss roundpipe fast | loss torch fused | loss bitsandbytes | loss roundpipe reference" in text
    )
    assert "torch fused AdamW (fp32 state)" in text and "vs bitsandbytes" in text
    for n in ("roundpipe fast", "roundpipe reference"):
        assert f"speedup of {n} AdamW8bit over torch fused fp32 AdamW: " in text
        assert (
            f"{n}: bit for bit bitsandbytes' AdamW8bit: parameters after each of the 2 steps, "
            "and every state entry after the last" in text
        )


@pytest.mark.skipif(not _bnb_importable(), reason="bitsandbytes cannot be imported here")
def test_demo_adamw8bit_reports_a_mismatch(capsys, monkeypatch):
    """A difference from bitsandbytes is named, with its step, and the exit status is 1."""
    monkeypatch.setattr(demo_eightbit, "params_mismatch", lambda a, b: "parameter 0 (512, 64): made up")
    assert demo.main(["--small", "--steps", "2", "--optimizer", "AdamW8bit"]) == 1
    captured = capsys.readouterr()
    assert "roundpipe fast: NOT bit for bit bitsandbytes' AdamW8bit (from step 1)" in captured.out
    assert "from step 1: parameter 0 (512, 64): made up" in captured.err


def test_demo_adamw8bit_without_bitsandbytes(capsys, monkeypatch):
    """bitsandbytes' import failing (as where it is not installed): the demo runs without its copy
    and says that roundpipe's was not compared with it."""
    for key in [k for k in sys.modules if k == "bitsandbytes" or k.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert demo_eightbit.bitsandbytes_optim() is None
    assert demo.main(["--small", "--steps", "2", "--optimizer", "AdamW8bit"]) == 0
    text = capsys.readouterr().out
    assert "step | loss roundpipe fast | loss torch fused\n" in text
    assert "vs bitsandbytes" not in text
    assert "speedup of roundpipe fast AdamW8bit over torch fused fp32 AdamW: " in text
    assert (
        "roundpipe fast: not compared with bitsandbytes (not installed here: pip install bitsandbytes)"
        in text
    )
