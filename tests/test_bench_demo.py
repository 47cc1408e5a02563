"""The benchmark and the demo still run (tiny configurations, a few seconds each; no timings).

Neither is given ``--threads``: that would set numexpr's thread count for the tests after these.
"""

import json
import os
import time

import pytest
import torch

from roundpipe import demo
from roundpipe.optim import bench


def test_traffic_is_derived_from_the_programs():
    # reads param, grad, exp_avg, exp_avg_sq and writes all but grad
    assert bench.bytes_per_element("Adam")[0] == 28
    # momentum 0.9: reads param, grad, momentum_buffer; writes param, momentum_buffer
    assert bench.bytes_per_element("SGD")[0] == 20
    # t0=1e6 keeps mu == 1: ax is assigned the new param, never read
    assert bench.bytes_per_element("ASGD") == (16, ("param", "grad"), ("param", "ax"))


def test_backends_all_expands_to_every_engine():
    names = bench._backends("fast,all")
    assert names[0] == "fast"
    native = bench._loads("native") is None  # numba installed
    assert names[1:] == [b for b in bench.ALL_BACKENDS if b != "native" or native]


def test_busy_processes_run_and_stop():
    with bench.busy(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # alive
    deadline = time.monotonic() + 5
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"--busy process {pid} still runs"
            time.sleep(0.05)


def test_busy_processes_stop_on_error():
    with pytest.raises(KeyboardInterrupt), bench.busy(1) as pids:
        raise KeyboardInterrupt
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_bench_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = "--quick --optimizers SGD --workloads small --backends fast,reference --busy 1"
    argv += f" --repeats 1 --warmup 0 --json {out}"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert "busy: 1 other process" in text
    assert "speedup over torch for-loop" in text
    assert "thread pools after the run (threadpoolctl): " in text  # torch's OpenMP pool at least
    result = json.loads(out.read_text())
    assert result["meta"]["busy"] == 1
    rows = result["workloads"]["small"]["optimizers"]
    assert rows["SGD"]["bytes_per_element"] == 20
    assert rows["SGD"]["checks"] == {"fast": "ok", "reference": "ok"}
    assert set(rows["SGD"]["median_ms"]) == {"for-loop", "foreach", "fused", "fast", "reference"}


def test_check_reports_a_mismatch(monkeypatch):
    params, grads = [torch.ones(3), torch.ones(2, 2)], [torch.ones(3), torch.ones(2, 2)]
    assert bench.check("SGD", "reference", params, grads) is None
    make = bench.make_optimizer

    def wrong_lr(config, name, ps):
        return make(config, name, ps) if config == bench.LOOP else torch.optim.SGD(ps, lr=0.5, momentum=0.9)

    monkeypatch.setattr(bench, "make_optimizer", wrong_lr)
    msg = bench.check("SGD", "reference", params, grads)
    assert msg.startswith("AssertionError") and "param 0" in msg


def test_demo_runs(capsys):
    assert demo.main(["--small", "--steps", "2", "--no-native"]) == 0
    text = capsys.readouterr().out
    assert "speedup of roundpipe (fast) over torch's default (for-loop) AdamW: " in text
    assert "roundpipe fast: a step matches torch's for-loop step" in text


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_bench_fsdp_runs():
    """The FSDP2 bench (two spawned gloo ranks) runs and prints a row per engine; ~10 s."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "roundpipe.optim.bench_fsdp", "--optimizers", "SGD", "--backends", "fast"]
    cmd += ["--workloads", "layers", "--repeats", "1", "--warmup", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_OPTIM_")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ")[:2] for line in done.stdout.splitlines() if line.startswith("SGD | ")]
    assert rows == [["SGD", "torch"], ["SGD", "fast"]], done.stdout
