"""The demo (``roundpipe/demo.py``) still runs (a tiny configuration; no timings are asserted).

It is never given ``--threads``: that would set numexpr's thread count for the tests after these.
"""

import pytest

from roundpipe import demo
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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_demo_mixed_precision_runs_bitwise(capsys, dtype):
    """--mixed: the model in low precision with fp32 masters, (loss scaling and) clipping, next
    to the same loop with torch.optim and casts; roundpipe's model ends bitwise equal to the
    for-loop composition's (the exit status says so too)."""
    assert demo.main(["--small", "--steps", "4", "--mixed", dtype]) == 0
    out = capsys.readouterr().out
    assert f"every parameter in {dtype}, fp32 masters" in out
    assert "speedup of roundpipe's optimizer phase over torch fused's" in out
    assert "the model is bitwise equal to the for-loop composition's" in out
    assert "roundpipe's clip norms against torch's get_total_norm of the same gradients" in out
