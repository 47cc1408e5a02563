"""The benchmark (``roundpipe/optim/bench/``, with ``bench/fsdp.py``) still runs (tiny
configurations, a few seconds each; no timings are asserted).

It is never given ``--threads``: that would set numexpr's thread count for the tests after these.
"""

import importlib
import json
import os
import time

import pytest
import torch

from roundpipe import demo
from roundpipe.optim import backends as rp_backends
from roundpipe.optim import bench
from roundpipe.optim.bench import cli, first_use, partners, workloads

traffic_module = importlib.import_module("roundpipe.optim.bench.traffic")  # bench.traffic: the function


def _tiny(monkeypatch, shapes=((3,), (100,), (5, 7))):
    """Every --workloads name runs one tiny workload instead, under the key "small" (the real
    one's 2,006 tensors take seconds on torch's for-loop)."""
    tiny = bench.Workload("small", f"{len(shapes)} tensors", tuple(shapes))
    monkeypatch.setattr(cli, "workload_parts", lambda name, quick: [tiny])


def test_traffic_is_derived_from_the_programs():
    # reads param, grad, exp_avg, exp_avg_sq and writes all but grad
    assert bench.bytes_per_element("Adam")[0] == 28
    # momentum 0.9: reads param, grad, momentum_buffer; writes param, momentum_buffer
    assert bench.bytes_per_element("SGD")[0] == 20
    # t0=1e6 keeps mu == 1: ax is assigned the new param, never read
    assert bench.bytes_per_element("ASGD") == (16, ("param", "grad"), ("param", "ax"))


def test_backend_names():
    assert bench.ALL_BACKENDS == ("fast", "fast:torch", "fast:numexpr", "reference")
    # all: every engine once, the default first, wherever it was named
    assert bench._backends("reference,all") == ["fast", "reference", "fast:torch", "fast:numexpr"]
    assert bench._backends("fast:numexpr,fast") == ["fast", "fast:numexpr"]
    assert bench._backends("native") == ["fast:numba"]  # the old name of fast:numba
    with pytest.raises(Exception, match="unknown backend 'auto'"):
        bench._backends("auto")
    assert cli.parse_args([]).backends == ["fast"]


def test_help_names_every_mode(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--busy", "--first-use", "--model", "--plot", "--json", "per_param"):
        assert option in text


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


def test_bench_runs(tmp_path, capsys, monkeypatch):
    # the small workload's name, a few tensors (its 2,006 take seconds on torch's for-loop)
    assert len(bench.workload_parts("small", quick=True)[0].shapes) == 2006
    _tiny(monkeypatch)
    out = tmp_path / "bench.json"
    argv = "--quick --optimizers SGD --workloads small --backends reference,fast --busy 1"
    argv += f" --repeats 1 --warmup 0 --json {out}"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert "busy: 1 other process" in text
    assert f"default backend: {bench.fast_engine()['text']}" in text
    assert "speedup over torch for-loop" in text
    assert "thread pools after the run (threadpoolctl): " in text  # torch's OpenMP pool at least
    result = json.loads(out.read_text())
    assert result["meta"]["busy"] == 1
    assert result["meta"]["backends"] == ["fast", "reference"]  # the default first
    kinds = result["meta"]["check_kind"]
    assert kinds == {b: "bit for bit" if rp_backends.get(b).exact else "close" for b in ("fast", "reference")}
    assert kinds["reference"] == "bit for bit"
    assert "reference bit for bit (integer views, NaN by position)" in text.replace("fast, ", "")
    rows = result["workloads"]["small"]["optimizers"]
    assert rows["SGD"]["bytes_per_element"] == 20
    assert rows["SGD"]["checks"] == {"fast": "ok", "reference": "ok"}
    assert list(rows["SGD"]["median_ms"]) == ["fast", "reference", "for-loop", "foreach", "fused"]


def test_after_backward_runs_a_forward_and_backward_before_each_timed_step(capsys, monkeypatch):
    _tiny(monkeypatch)
    calls = []
    real = cli.ForwardBackward

    class Counting(real):
        def __call__(self):
            calls.append(1)
            super().__call__()
            assert all(w.grad is not None for w in self.weights)

    monkeypatch.setattr(cli, "ForwardBackward", Counting)
    argv = "--quick --optimizers SGD --workloads small --backends fast --repeats 2 --warmup 0"
    assert bench.main([*argv.split(), "--after-backward"]) == 0
    text = capsys.readouterr().out
    assert "each timed step right after a forward and backward pass (--after-backward)" in text
    assert len(calls) == 2 * 4  # a pass before each timed step of fast, for-loop, foreach and fused


def test_per_param_workload(tmp_path, capsys, monkeypatch):
    # the real parts: 256 one-tensor optimizers of 4Ki elements, and 4 of 2Mi (quick) / 4Mi
    small, large = bench.workload_parts("per_param", quick=True)
    assert (small.name, small.per_param, small.shapes) == ("per_param_small", True, ((4096,),) * 256)
    assert (large.name, large.shapes) == ("per_param_large", ((2 * 2**20,),) * 4)
    assert bench.workload_parts("per_param_large", quick=False)[0].shapes == ((4 * 2**20,),) * 4
    # a tiny one through the whole run: 8 optimizers of one 64-element tensor each
    tiny = bench.Workload("per_param_small", "8 one-parameter optimizers", ((64,),) * 8, per_param=True)
    monkeypatch.setattr(cli, "workload_parts", lambda name, quick: [tiny])
    out = tmp_path / "bench.json"
    argv = "--quick --optimizers SGD,Adam --workloads per_param --backends fast,fast:numexpr"
    argv += f" --repeats 1 --warmup 0 --json {out}"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert "median ms per step (8 step() calls each):" in text
    assert "us per step() call (median / 8 calls):" in text
    assert "fast:numexpr close (torch.testing.assert_close)" in text
    res = json.loads(out.read_text())["workloads"]["per_param_small"]
    assert res["per_param"] is True and res["tensors"] == 8
    for name in ("SGD", "Adam"):
        row = res["optimizers"][name]
        assert list(row["median_ms"]) == ["fast", "fast:numexpr", "for-loop", "fused"]  # no foreach
        assert row["checks"] == {"fast": "ok", "fast:numexpr": "ok"}
        assert row["fast"]["us_per_step_call"] == pytest.approx(row["median_ms"]["fast"] * 1e3 / 8)
    opt = bench.make_optimizer(
        "rp fast", "SGD", bench.clone_params([torch.ones(3)] * 5, [torch.ones(3)] * 5), True
    )
    assert len(opt.optimizers) == 5 and all(len(o.param_groups[0]["params"]) == 1 for o in opt.optimizers)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_partners_mode(tmp_path, capsys, monkeypatch, dtype):
    """--partners on a tiny workload: the table, the bit-for-bit verdict, the JSON rows."""
    _tiny(monkeypatch, ((3,), (100,), (0,), (5, 7)))
    out = tmp_path / "partners.json"
    flag = "--partners" if dtype == "bfloat16" else f"--partners {dtype}"  # bfloat16: the flag's default
    argv = f"--quick --optimizers SGD,Adam --workloads small {flag} --repeats 1 --warmup 0 --json {out}"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert f"benchmark (quick, --partners {dtype})" in text
    head = "optimizer | composition | fused | torch composition | speedup | B/elem comp. | B/elem fused"
    head += " | traffic"
    assert head in text
    assert (
        f"bit for bit, fused vs composition after 2 steps (masters, {dtype} partners, every state tensor):"
        in text
    )
    assert "\n  SGD: equal\n  Adam: equal" in text
    assert "MISMATCH" not in text and "FAILURES" not in text
    result = json.loads(out.read_text())
    assert result["meta"]["partners"] == dtype
    rows = result["workloads"]["small"]["optimizers"]
    for name, fp32, path in (("SGD", 20, "fused"), ("Adam", 28, "fused")):
        row = rows[name]
        assert list(row["median_ms"]) == ["composition", "fused", "torch composition"]
        assert row["checks"] == {"fused": "ok"} and row["bit_for_bit"] is True
        assert row["torch_path"] == path
        # fused: grad read at 2 bytes, partner written at 2; composition: + widen 2+4, round back 4+2
        assert row["bytes_per_element_by_config"] == {
            "composition": fp32 + 12,
            "fused": fp32,
            "torch composition": fp32 + 12,
        }
        assert row["traffic_ratio"] == pytest.approx((fp32 + 12) / fp32)
        ms = row["median_ms"]
        assert row["speedup_fused_vs_composition"] == pytest.approx(ms["composition"] / ms["fused"])


@pytest.mark.parametrize("dtype, words", [("float16", "loss scaling and clipping"), ("bfloat16", "clipping")])
def test_partners_amp_mode(tmp_path, capsys, monkeypatch, dtype, words):
    """--partners --amp: scaling (float16) and clipping around the step, fused equal to the
    composition, the bytes of the unscale, norm and clip passes."""
    _tiny(monkeypatch)
    out = tmp_path / "amp.json"
    argv = f"--quick --optimizers SGD,AdamW --workloads small --partners {dtype} --amp --repeats 1"
    assert bench.main([*argv.split(), "--warmup", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"partners, {words} " in text
    assert "\n  SGD: equal (total norm vs torch's get_total_norm: " in text
    assert "\n  AdamW: equal (total norm vs torch's get_total_norm: " in text
    assert "MISMATCH" not in text and "FAILURES" not in text
    result = json.loads(out.read_text())
    assert result["meta"]["amp"] is True
    row = result["workloads"]["small"]["optimizers"]["AdamW"]
    assert 0 <= row["norm_relative_difference_vs_torch"] <= 1e-5
    scaled = dtype == "float16"
    # AdamW fp32: 28; fused: + one read (2) for the inf check and the norm; composition: + widen
    # 6, round back 6, norm 4, clip 8 [+ unscale 8]
    assert row["bytes_per_element_by_config"]["fused"] == 28 + 2
    assert row["bytes_per_element_by_config"]["composition"] == 28 + 12 + 12 + (8 if scaled else 0)
    with pytest.raises(SystemExit):
        bench.parse_args(["--amp"])  # --amp needs --partners


def test_option_overrides_a_hyperparameter_for_the_run(tmp_path, capsys, monkeypatch):
    """--option SGD.momentum=0: plain SGD in the run (its traffic, the header, the JSON), the
    bench's own options back afterwards; malformed ones are refused."""
    _tiny(monkeypatch, ((3,), (100,)))
    out = tmp_path / "plain.json"
    argv = "--quick --optimizers SGD --workloads small --partners --option SGD.momentum=0 --repeats 1"
    assert bench.main([*argv.split(), "--warmup", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hyperparameters set (the rest are torch's defaults): SGD momentum=0" in text
    row = json.loads(out.read_text())["workloads"]["small"]["optimizers"]["SGD"]
    # plain SGD: param read and written, grad read (12 bytes); with partners 2 + 2 instead of 4
    assert row["bytes_per_element_by_config"] == {"composition": 24, "fused": 12, "torch composition": 24}
    assert row["options"] == {"momentum": 0} and row["bit_for_bit"] is True
    assert bench.OPTIONS["SGD"] == {"momentum": 0.9}
    for bad in ("SGD.momentum", "SGD=0", "Nope.lr=1", "SGD.lr=one", "SGD.momentun=0"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--option", bad])


def test_partners_arguments_and_check(monkeypatch):
    args = cli.parse_args(["--partners"])
    assert args.partners == "bfloat16" and args.workloads == ["large", "small", "transformer"]
    assert cli.parse_args([]).partners is None and cli.parse_args([]).workloads == list(bench.WORKLOADS)
    for bad in ("--workloads per_param", "--backends reference", "--first-use", "int8"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--partners", *bad.split()])
    params, grads = [torch.ones(3), torch.randn(2, 2)], [torch.ones(3), torch.randn(2, 2)]
    assert partners.check("Adam", torch.float16, params, grads) == (None, None)
    step = partners.Partnered.step

    def one_off(self):  # the fused configuration's last partner element one bit up
        step(self)
        if self.grads is None:
            self.partners[1].data.view(-1).view(torch.int16)[-1] += 1

    monkeypatch.setattr(partners.Partnered, "step", one_off)
    msg, _ = partners.check("Adam", torch.bfloat16, params, grads)
    assert msg.startswith("AssertionError: partner 1: 1 of 4 elements differ in their bits; first at 3"), msg


def test_bits_mismatch():
    x = torch.tensor([1.0, float("nan"), 0.0])
    assert bench.bits_mismatch(x, x.clone()) is None  # NaN meets NaN
    assert "1 of 3 elements differ" in bench.bits_mismatch(x, torch.tensor([1.0, float("nan"), -0.0]))
    assert bench.bits_mismatch(x, torch.tensor([1.0, 2.0, 0.0])) is not None  # NaN vs a number
    assert bench.bits_mismatch(x, x.double()).startswith("dtype/shape")


def test_check_is_bitwise_where_the_backend_claims_it(monkeypatch):
    params, grads = [torch.ones(3), torch.ones(2, 2)], [torch.ones(3), torch.ones(2, 2)]
    assert bench.check("SGD", "reference", params, grads) is None
    assert bench.check("SGD", "fast:numexpr", params, grads, per_param=True) is None
    make = workloads.make_optimizer

    class OneUlpOff:  # torch's SGD, then the last element of the second parameter one ulp up
        def __init__(self, ps):
            self.opt, self.ps = torch.optim.SGD(ps, lr=1e-3, momentum=0.9), ps
            self.state = self.opt.state

        def step(self):
            self.opt.step()
            with torch.no_grad():
                p = self.ps[1].view(-1)
                p[-1] = torch.nextafter(p[-1], torch.tensor(float("inf")))

    def off(config, name, ps, per_param=False):
        return make(config, name, ps) if config == bench.LOOP else OneUlpOff(ps)

    monkeypatch.setattr(workloads, "make_optimizer", off)
    assert workloads.exact("reference") and not workloads.exact("fast:numexpr")
    msg = bench.check("SGD", "reference", params, grads)  # bit for bit: caught
    assert msg.startswith("AssertionError: param 1: 1 of 4 elements differ in their bits; first at 3"), msg
    assert bench.check("SGD", "fast:numexpr", params, grads) is None  # close: within assert_close

    def wrong_lr(config, name, ps, per_param=False):
        return make(config, name, ps) if config == bench.LOOP else torch.optim.SGD(ps, lr=0.5, momentum=0.9)

    monkeypatch.setattr(workloads, "make_optimizer", wrong_lr)
    msg = bench.check("SGD", "fast:numexpr", params, grads)
    assert msg.startswith("AssertionError: param 0: ") and "Mismatched elements" in msg


def test_first_use_small(tmp_path, capsys, monkeypatch):
    """--first-use on the demo's small model: 3 fresh interpreters (one import, cold, warm); ~10 s."""
    monkeypatch.setattr(first_use, "IMPORT_RUNS", 1)
    out = tmp_path / "first_use.json"
    assert bench.main(["--first-use", "--model", "small", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "import roundpipe.optim beyond import torch" in text
    assert "first step, cold kernel cache" in text and "first step, warm kernel cache" in text
    res = json.loads(out.read_text())["first_use"]
    assert res["model"] == "small" and res["backend"] == "fast"
    assert res["tensors"] == len(list(demo.build_model("small").parameters()))
    steps = (res["cold_steps_s"], res["warm_steps_s"], res["torch_fused_steps_s"])
    assert [len(s) for s in steps] == [first_use.STEPS] * 3
    assert "torch fused: first step - normal step" in text and isinstance(res["scipy"], bool)
    assert len(res["import_samples_s"]) == 1
    assert all(t > 0 for t in [res["import_s"], *res["cold_steps_s"], *res["warm_steps_s"]])
    assert set(res["meets_goals"]) == set(first_use.GOALS)
    assert res["engine"]["cold"]["engine"] == rp_backends.get("fast").engine()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_bench_fsdp_runs():
    """The FSDP2 bench (two spawned gloo ranks) runs and prints a row per engine; ~10 s."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "roundpipe.optim.bench.fsdp", "--optimizers", "SGD", "--backends", "native"]
    cmd += ["--workloads", "layers", "--repeats", "1", "--warmup", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_OPTIM_")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ")[:2] for line in done.stdout.splitlines() if line.startswith("SGD | ")]
    assert rows == [["SGD", "fast:numba"], ["SGD", "torch for-loop"]], done.stdout


def test_staged_traffic_is_derived_from_each_pass():
    """Adafactor on a matrix: pass 1 reads param and grad (norms), pass 2 grad (the update's
    norm), pass 3 grad and param and writes param: 24 bytes; on a vector 32 (variance read in
    both passes, written in the last); Muon 32 (its bfloat16 update written and read at 2)."""
    assert traffic_module.staged_bytes("Adafactor", (64, 32))[0] == 24
    assert traffic_module.staged_bytes("Adafactor", (2, 8, 16))[0] == 24  # factored over the last two
    assert traffic_module.staged_bytes("Adafactor", (64,))[0] == 32
    per, reads, writes = traffic_module.workload_bytes("Adafactor", [(30, 10), (100,)])
    assert per == pytest.approx((24 * 300 + 32 * 100) / 400) and writes == ("3:param",)
    assert reads == ("1:param", "1:grad", "2:grad", "3:grad", "3:param")
    assert traffic_module.workload_bytes("Adam", [(30, 10)])[0] == 28
    if "Muon" in bench.ALL_OPTIMIZERS:
        nbytes, passes = traffic_module.staged_bytes("Muon", (16, 8))
        assert nbytes == 32 and passes[0][1] == ("update",)


def test_default_optimizers_take_adafactor_not_muon():
    args = cli.parse_args([])
    assert "Adafactor" in args.optimizers and "Muon" not in args.optimizers
    assert args.optimizers[: len(workloads.SPECS)] == list(workloads.SPECS)
    assert "Adafactor" not in cli.parse_args(["--partners"]).optimizers  # elementwise only
    with pytest.raises(SystemExit):
        cli.parse_args(["--partners", "--optimizers", "Adafactor"])
    assert workloads.tensors_for("Adafactor", [(3,), (0,), ()]) == (
        [0, 2],
        "empty tensors left out: torch's Adafactor divides by a tensor's element count",
    )
    assert workloads.tensors_for("Muon", [(3,), (4, 5), (2, 3, 4)])[0] == [1]
    assert workloads.tensors_for("SGD", [(0,)]) == ([0], None)


def test_bench_runs_adafactor(tmp_path, capsys, monkeypatch):
    """Adafactor on matrices, vectors and an empty tensor (left out, as torch's step divides by
    its element count): checked bit for bit against torch's for-loop, each parameter's own state
    tensors (row_var and col_var, or variance), the state's bytes per element in the header."""
    _tiny(monkeypatch, ((3,), (0,), (100,), (5, 7), (2, 4, 6)))
    out = tmp_path / "bench.json"
    argv = "--quick --optimizers Adafactor,AdamW --workloads small --backends fast,reference"
    assert bench.main([*argv.split(), "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Adafactor: empty tensors left out: torch's Adafactor divides by a tensor's element" in text
    assert "B/elem of Adafactor and Muon: each pass's own traffic" in text
    assert "optimizer state, bytes per parameter element (state B/el: " in text
    assert "FAILURES" not in text
    rows = json.loads(out.read_text())["workloads"]["small"]["optimizers"]
    row = rows["Adafactor"]
    assert row["checks"] == {"fast": "ok", "reference": "ok"}
    assert list(row["median_ms"]) == ["fast", "reference", "for-loop", "foreach"]  # no fused
    assert row["numel"] == 3 + 100 + 35 + 48
    # vectors: variance (4 bytes an element); matrices: a row and a column; a 0-d step each
    state = 4 * (3 + 100) + 4 * (5 + 7) + 4 * (2 * 4 + 2 * 6) + 4 * 4
    assert row["state_bytes_per_element"] == pytest.approx(state / row["numel"])
    assert row["bytes_per_element"] == pytest.approx(round((32 * 103 + 24 * 83) / 186, 2))
    adamw = rows["AdamW"]
    assert adamw["state_bytes_per_element"] == pytest.approx((8 * 186 + 4 * 5) / 186)  # all five tensors


@pytest.mark.skipif("Muon" not in bench.ALL_OPTIMIZERS, reason="torch < 2.9: no torch.optim.Muon")
def test_bench_runs_muon_on_matrices_with_its_newton_schulz_apart(tmp_path, capsys, monkeypatch):
    _tiny(monkeypatch, ((3,), (16, 8), (8, 24)))
    out = tmp_path / "bench.json"
    argv = "--quick --optimizers Muon --workloads small --backends fast"
    assert bench.main([*argv.split(), "--repeats", "2", "--warmup", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Muon: only the 2-D tensors: Muon steps matrices: 2 of 3 tensors, 320 elements" in text
    assert "time in torch's Newton-Schulz" in text and "FAILURES" not in text
    row = json.loads(out.read_text())["workloads"]["small"]["optimizers"]["Muon"]
    assert row["checks"] == {"fast": "ok"} and list(row["median_ms"]) == ["fast", "for-loop"]
    for config in ("fast", "for-loop"):
        assert 0 < row["callout_median_ms"][config] <= max(row["samples_ms"][config])
        assert len(row["callout_samples_ms"][config]) == 2
    import torch.optim._muon as muon

    assert muon._zeropower_via_newtonschulz.__name__ == "_zeropower_via_newtonschulz"  # unwrapped
