"""The bench's 8-bit rows (``--optimizers AdamW8bit``, ``roundpipe/optim/bench/eightbit.py``) on
tiny workloads: with bitsandbytes, without it (its import made to fail), beside the other
optimizers, and the peak-memory measurement. No timings are asserted.

torchao's import is made to fail in the runs (its step compiles per shape: seconds each); the
peak-memory subprocesses are replaced by a stub except in the tests of that measurement.
"""

import json
import re
import subprocess
import sys

import pytest
import torch

from roundpipe.optim import bench
from roundpipe.optim.bench import eightbit, eightbit_memory

TINY = ((3,), (100,), (5000,), (64, 128))  # fp32 state under 4096 elements, 8-bit above


def _bnb_importable() -> bool:
    return eightbit.third_party(eightbit.BNB)[0] is not None


needs_bnb = pytest.mark.skipif(not _bnb_importable(), reason="bitsandbytes cannot be imported here")


def _missing(monkeypatch, *packages):
    """``import <package>`` (and its submodules') fails as where it is not installed."""
    for name in packages:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, key)
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def tiny(monkeypatch):
    """The 8-bit rows on one tiny workload under each --workloads name, torchao missing, and a
    stub peak measurement (what it was asked is recorded)."""
    monkeypatch.setattr(eightbit, "workload_parts", lambda name, quick: [bench.Workload(name, "tiny", TINY)])
    _missing(monkeypatch, "torchao")
    asked = []

    def measure(config, name, shapes, threads):
        asked.append(config)
        return 1000, None

    monkeypatch.setattr(eightbit_memory, "measure", measure)
    return asked


def _run(tmp_path, capsys, argv):
    out = tmp_path / "bench.json"
    code = bench.main([*argv.split(), "--repeats", "1", "--warmup", "1", "--json", str(out)])
    return code, capsys.readouterr().out, json.loads(out.read_text())


@needs_bnb
def test_eightbit_rows_beside_bitsandbytes(tmp_path, capsys, tiny):
    code, text, doc = _run(tmp_path, capsys, "--optimizers AdamW8bit --workloads small")
    assert code == 0
    assert "roundpipe against torch's fused fp32 step, bitsandbytes' and torchao's" in text
    assert "busy processes 0; load average before the run " in text
    assert "(bitsandbytes: 0." in text and "torchao: not installed)" in text
    assert (
        "AdamW8bit: against bitsandbytes (2 steps, parameters and every state entry): fast bit for bit"
        in text
    )
    assert re.search(r"\ntorchao +\| not installed", text)
    assert "workload small: tiny; 4 tensors, 13,295 elements" in text
    assert "summary:" not in text  # no normal rows: no normal report
    row = doc["eightbit"]["workloads"]["small"]["optimizers"]["AdamW8bit"]
    assert row["checks_against_bitsandbytes"] == {"fast": "ok"} and row["check_skipped"] is None
    cols = row["columns"]
    assert list(cols) == ["fast", "torch fused", "bitsandbytes", "torchao"]
    assert cols["torchao"]["error"] == "not installed" and cols["torchao"]["median_ms"] is None
    for c in ("fast", "torch fused", "bitsandbytes"):
        assert cols[c]["error"] is None and cols[c]["median_ms"] > 0
        assert cols[c]["peak_extra_per_param"] == pytest.approx(1000 / 13295)
    # 16 bytes an element for 8-bit state (5000 and 8192 elements), 28 for fp32 (3 and 100)
    assert cols["fast"]["bytes_per_element"] == round((16 * 13192 + 28 * 103) / 13295, 2)
    assert cols["torch fused"]["bytes_per_element"] == 28
    assert cols["torch fused"]["state_bytes_per_param"] == pytest.approx(8, abs=0.01)  # + the steps
    # bitsandbytes' state, and so roundpipe's: 2 bytes + absmax on 8-bit tensors, 8 on the others
    assert cols["fast"]["state_bytes_per_param"] == pytest.approx(
        cols["bitsandbytes"]["state_bytes_per_param"]
    )
    assert tiny == ["rp fast", "torch fused", "bitsandbytes"]  # each timed column's peak measured


def test_eightbit_rows_without_bitsandbytes(tmp_path, capsys, tiny, monkeypatch):
    _missing(monkeypatch, "bitsandbytes")
    argv = "--optimizers SGD,AdamW8bit --workloads small --backends fast,reference --no-one-thread"
    code, text, doc = _run(tmp_path, capsys, argv)
    assert code == 0
    assert "bitsandbytes: not installed; torchao: not installed" in text
    assert "AdamW8bit: not checked against bitsandbytes (bitsandbytes not installed)" in text
    assert re.search(r"\nbitsandbytes +\| not installed", text)
    # the other optimizers' report as without the 8-bit rows, before them
    assert text.index("speedup over torch for-loop") < text.index("8-bit optimizers: roundpipe")
    assert list(doc["workloads"]["small"]["optimizers"]) == ["SGD"]
    assert doc["meta"]["optimizers"] == ["SGD"]
    cols = doc["eightbit"]["workloads"]["small"]["optimizers"]["AdamW8bit"]["columns"]
    assert list(cols) == ["fast", "reference", "torch fused", "bitsandbytes", "torchao"]
    assert cols["reference"]["median_ms"] > 0 and cols["bitsandbytes"]["error"] == "not installed"
    assert "roundpipe fast speedup | roundpipe reference speedup" in text
    assert tiny == ["rp fast", "rp reference", "torch fused"]


def test_eightbit_workloads():
    """large is the issue's 4 x 4M in both modes; per_param is not run for these rows."""
    for quick in (True, False):
        (large,) = eightbit.workload_parts("large", quick)
        assert large.shapes == ((4 * 2**20,),) * 4
        assert eightbit.workload_parts("per_param", quick) == []
        assert eightbit.workload_parts("small", quick) == bench.workload_parts("small", quick)


def test_eightbit_arguments():
    assert bench.parse_args(["--optimizers", "adamw8bit"]).optimizers == ["AdamW8bit"]
    assert "AdamW8bit" not in bench.parse_args([]).optimizers  # only when named
    for extra in (["--partners"], ["--first-use"], ["--plot", "x.png"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--optimizers", "AdamW8bit", *extra])


def test_bytes_per_element_and_state_bytes():
    assert eightbit.step_bytes("rp fast", [(4096,)]) == 16
    assert eightbit.step_bytes("bitsandbytes", [(4095,)]) == 28
    assert eightbit.step_bytes("torch fused", [(4096,)]) == 28
    assert eightbit.step_bytes("torchao", [(4096 + 1,)]) == 28  # torchao wants whole blocks
    assert eightbit.step_bytes("rp fast", [(4096,), (4096,), (4096,), (100,)]) == round(
        (16 * 3 * 4096 + 28 * 100) / (3 * 4096 + 100), 2
    )
    shared = torch.zeros(256)
    state = {0: {"a": torch.zeros(10, dtype=torch.uint8), "q": shared, "step": 3}, 1: {"q": shared}}
    assert eightbit.state_bytes(state) == 10 + 256 * 4  # the shared codebook once


# the child's measurement in a fresh interpreter, as the bench runs it: in the test process,
# memory an earlier test freed but kept mapped would hide part of the step's temporaries
_CHILD = """
import io, json, sys
import torch
from roundpipe.optim.bench import eightbit_columns, eightbit_memory


class Stepping:
    # a stand-in optimizer whose step() holds two touched buffers of half of nbytes each, as a
    # step that dequantizes into full-size buffers does
    def step(self):
        if NBYTES:
            a = torch.ones(NBYTES // 8)
            b = a + 1.0
            del a, b


eightbit_columns.make = lambda config, name, params: Stepping()
job = {"config": "x", "optimizer": "AdamW8bit", "shapes": [[4]], "threads": torch.get_num_threads()}
sys.stdin = io.StringIO(json.dumps(job))
eightbit_memory.child()
"""


@pytest.mark.skipif(eightbit_memory.supported() is not None, reason="no resettable high-water mark")
@pytest.mark.parametrize("nbytes", [0, 64 * 2**20])
def test_peak_memory_sees_a_step_s_temporaries(nbytes):
    """The child's measurement: a step holding 2 x 32 MiB shows them (at 32 MiB, glibc maps every
    block, whatever its threshold), a step holding nothing about 0."""
    source = _CHILD.replace("NBYTES", str(nbytes))
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    extra = json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]
    assert len(extra) == eightbit_memory.STEPS
    if nbytes:
        assert all(nbytes * 0.95 <= e <= nbytes + 8 * 2**20 for e in extra), extra
    else:
        assert all(e < 4 * 2**20 for e in extra), extra


@pytest.mark.skipif(eightbit_memory.supported() is not None, reason="no resettable high-water mark")
def test_peak_memory_subprocess_of_torch_fused():
    """The real subprocess for one column: torch's fused step allocates nothing a parameter."""
    peak, why = eightbit_memory.measure("torch fused", "AdamW8bit", [(2**20,)], threads=1)
    assert why is None and 0 <= peak / 2**20 < 1.0
