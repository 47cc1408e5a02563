"""The benchmark (``roundpipe/optim/bench/``, with ``bench/fsdp.py``) still runs (tiny
configurations, a few seconds each; no timings are asserted).

Only the one-thread tests give ``--threads`` or change a thread count, each restoring torch's
and numexpr's counts after it (``threads_restored``): a run given ``--threads`` leaves them set
for the tests after it.
"""

import importlib
import json
import os
import time

import numexpr
import pytest
import torch

import roundpipe.optim.threads as rp_threads
from roundpipe import demo
from roundpipe.optim import backends as rp_backends
from roundpipe.optim import bench
from roundpipe.optim.bench import cli, first_use, partners, timing, workloads

traffic_module = importlib.import_module("roundpipe.optim.bench.traffic")  # bench.traffic: the function


def _tiny(monkeypatch, shapes=((3,), (100,), (5, 7))):
    """Every --workloads name runs one tiny workload instead, under the key "small" (the real
    one's 2,006 tensors take seconds on torch's for-loop)."""
    tiny = bench.Workload("small", f"{len(shapes)} tensors", tuple(shapes))
    monkeypatch.setattr(cli, "workload_parts", lambda name, quick: [tiny])


def _tiny_named(monkeypatch, shapes=((3,), (100,), (5, 7))):
    """Every --workloads name runs one tiny workload under its own name (``large`` among them:
    the summary's and the one-thread pass's workload)."""
    monkeypatch.setattr(
        cli, "workload_parts", lambda name, quick: [bench.Workload(name, f"{len(shapes)} tensors", shapes)]
    )


@pytest.fixture
def threads_restored():
    """torch's and numexpr's thread counts put back after the test, as they were before it."""
    before = torch.get_num_threads(), numexpr.get_num_threads()
    yield before
    torch.set_num_threads(before[0])
    numexpr.set_num_threads(before[1])


@pytest.fixture
def two_threads(monkeypatch, threads_restored):
    """The run at 2 threads on (what it reads as) 2 cpus, so that it takes its one-thread pass
    (the tests run at OMP_NUM_THREADS=1, and a CI machine may have one cpu)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    torch.set_num_threads(2)
    return threads_restored


def _threads_at_make(monkeypatch, fail_at_one=False):
    """Each configuration ``bench_one`` makes, with the threads torch, numexpr and roundpipe's
    step then run on; with ``fail_at_one``, roundpipe's default backend raises at one thread."""
    made = []
    real = timing.make_optimizer

    def make(config, name, params, per_param=False):
        threads = (torch.get_num_threads(), numexpr.get_num_threads(), rp_threads.get_num_threads())
        made.append((config, name, threads))
        if fail_at_one and config == "rp fast" and threads[2] == 1:
            raise RuntimeError("broken at one thread")
        return real(config, name, params, per_param)

    monkeypatch.setattr(timing, "make_optimizer", make)
    return made


def _summary(text: str) -> str:
    return text[text.index("summary: roundpipe fast against torch's fastest path") :]


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
    assert bench.parse_backends("reference,all") == ["fast", "reference", "fast:torch", "fast:numexpr"]
    assert bench.parse_backends("fast:numexpr,fast") == ["fast", "fast:numexpr"]
    assert bench.parse_backends("native") == ["fast:numba"]  # the old name of fast:numba
    with pytest.raises(Exception, match="unknown backend 'auto'"):
        bench.parse_backends("auto")
    assert cli.parse_args([]).backends == ["fast"]


def test_help_names_every_mode(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--busy", "--first-use", "--model", "--plot", "--json", "per_param", "--no-one-thread"):
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


def test_summary_at_the_run_s_threads_and_at_one_thread(tmp_path, capsys, monkeypatch, two_threads):
    """A default run takes a one-thread pass (roundpipe's default backend against torch's fastest
    path, on large and transformer, every optimizer but Muon) and ends with the summary, a column
    at the run's threads and one at one thread; the thread counts are restored afterwards."""
    _tiny_named(monkeypatch)
    made = _threads_at_make(monkeypatch)
    names = "Adam,SGD,Adafactor" + (",Muon" if "Muon" in bench.ALL_OPTIMIZERS else "")
    out = tmp_path / "bench.json"
    argv = f"--quick --optimizers {names} --workloads large,small --repeats 1 --warmup 0 --json {out}"
    assert bench.main(argv.split()) == 0
    assert (torch.get_num_threads(), numexpr.get_num_threads()) == (2, two_threads[1])
    assert rp_threads._num_threads is None and rp_threads.get_num_threads() == 2
    # the pass: only its configurations at one thread, every pool at one thread
    at_one = [(c, n) for c, n, threads in made if threads == (1, 1, 1)]
    assert at_one == [
        ("rp fast", "Adam"),
        ("torch fused", "Adam"),
        ("rp fast", "SGD"),
        ("torch fused", "SGD"),
        ("rp fast", "Adafactor"),
        ("torch for-loop", "Adafactor"),
        ("torch foreach", "Adafactor"),
    ]
    assert all(threads[0] == 2 and threads[2] == 2 for c, n, threads in made if (c, n) not in at_one)
    summary = _summary(capsys.readouterr().out)
    lines = summary.splitlines()
    assert "1 thread: every thread pool at one thread, as on each rank of a torchrun launch" in lines[1]
    assert [c.strip() for c in lines[2].split(" | ")] == [
        "workload",
        "optimizer",
        "torch path",
        "2 threads",
        "1 thread",
    ]
    rows = [[c.strip() for c in line.split(" | ")] for line in lines[4:]]
    assert [r[:3] for r in rows][:2] == [["large", "Adam", "fused"], ["large", "SGD", "fused"]]
    assert rows[2][:2] == ["large", "Adafactor"] and rows[2][2] in (
        "for-loop",
        "foreach",
        "for-loop / foreach",
        "foreach / for-loop",
    )
    assert len(rows) == 3 and all(r[3].endswith("x") and r[4].endswith("x") for r in rows)  # no small, Muon
    doc = json.loads(out.read_text())
    assert doc["meta"]["one_thread_skipped"] is None
    assert doc["one_thread"]["threads"] == {"torch": 1, "numexpr": 1, "roundpipe": 1}
    one = doc["one_thread"]["workloads"]
    assert list(one) == ["large"] and list(one["large"]["optimizers"]) == ["Adam", "SGD", "Adafactor"]
    assert list(one["large"]["optimizers"]["Adam"]["median_ms"]) == ["fast", "fused"]
    assert [(r["workload"], r["optimizer"]) for r in doc["summary"]] == [
        ("large", "Adam"),
        ("large", "SGD"),
        ("large", "Adafactor"),
    ]
    for r in doc["summary"]:
        for cell in (r["run"], r["one_thread"]):
            assert cell["error"] is None and cell["ratio"] == pytest.approx(cell["torch_ms"] / cell["rp_ms"])
    assert doc["summary"][0]["one_thread"]["rp_ms"] == one["large"]["optimizers"]["Adam"]["median_ms"]["fast"]


@pytest.mark.parametrize(
    "flags, why",
    [
        ("--no-one-thread", "--no-one-thread"),
        ("--threads 2", "--threads 2: the whole run is at that count"),
        ("--threads 1", "--threads 1: the whole run is at that count"),
    ],
)
def test_no_one_thread_pass(tmp_path, capsys, monkeypatch, two_threads, flags, why):
    """--no-one-thread, or --threads (the whole run at that count): no pass, the summary's column
    at the run's threads alone, and a line that says why."""
    _tiny_named(monkeypatch)
    made = _threads_at_make(monkeypatch)
    out = tmp_path / "bench.json"
    argv = f"--quick --optimizers Adam,SGD --workloads large --repeats 1 --warmup 0 {flags} --json {out}"
    assert bench.main(argv.split()) == 0
    n = int(flags.split()[1]) if flags.startswith("--threads") else 2
    assert {(threads[0], threads[2]) for _, _, threads in made} == {(n, n)}  # none at another count
    assert cli.parse_args([]).no_one_thread is False
    summary = _summary(capsys.readouterr().out)
    assert f"no one-thread column: {why}" in summary
    head = [c.strip() for c in summary.splitlines()[2].split(" | ")]
    assert head == ["workload", "optimizer", "torch path", f"{n} thread" + ("s" if n > 1 else "")]
    assert "1 thread: every thread pool at one thread" not in summary
    doc = json.loads(out.read_text())
    assert "one_thread" not in doc and doc["meta"]["one_thread_skipped"] == why
    assert [r["one_thread"] for r in doc["summary"]] == [None, None]


def test_no_one_thread_pass_on_one_thread_or_without_its_workloads(capsys, monkeypatch, threads_restored):
    _tiny_named(monkeypatch)
    torch.set_num_threads(1)  # as under OMP_NUM_THREADS=1 (these tests' own setting)
    argv = "--quick --optimizers Adam --workloads large --repeats 1 --warmup 0"
    assert bench.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert "no one-thread column: the run is at one thread already" in _summary(text)
    torch.set_num_threads(2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert bench.main(argv.replace("large", "small").split()) == 0
    assert "summary:" not in capsys.readouterr().out  # small has no summary rows


def test_one_thread_error_shows_in_the_summary(tmp_path, capsys, monkeypatch, two_threads):
    """roundpipe failing only at one thread: an ERROR cell and its message in the summary, a
    failure (exit status 1), no crash, and the thread counts restored."""
    _tiny_named(monkeypatch)
    _threads_at_make(monkeypatch, fail_at_one=True)
    out = tmp_path / "bench.json"
    argv = f"--quick --optimizers Adam --workloads large --repeats 1 --warmup 0 --json {out}"
    assert bench.main(argv.split()) == 1
    assert torch.get_num_threads() == 2 and rp_threads._num_threads is None
    text = capsys.readouterr().out
    assert "large Adam fast (one thread): RuntimeError: broken at one thread" in text  # FAILURES
    summary = _summary(text)
    row = [c.strip() for c in summary.splitlines()[4].split(" | ")]
    assert row[:3] == ["large", "Adam", "fused"] and row[3].endswith("x") and row[4] == "ERROR"
    assert "large Adam, 1 thread: RuntimeError: broken at one thread" in summary
    cell = json.loads(out.read_text())["summary"][0]["one_thread"]
    assert cell["ratio"] is None and cell["error"] == "RuntimeError: broken at one thread"


def test_one_thread_restores_the_counts_on_error(threads_restored):
    torch.set_num_threads(2)
    numexpr.set_num_threads(2)
    rp_threads.set_num_threads(3)
    try:
        with pytest.raises(KeyboardInterrupt), timing.one_thread() as threads:
            assert threads == {"torch": 1, "numexpr": 1, "roundpipe": 1}
            raise KeyboardInterrupt
        assert (torch.get_num_threads(), numexpr.get_num_threads(), rp_threads.get_num_threads()) == (2, 2, 3)
    finally:
        rp_threads.set_num_threads(None)
