"""bench.ab --decoder: two decoder runtimes (bench.decoder's) timed in alternating rounds, prefill and decode.
The direction, the rounds and the rows of what a runtime cannot run are checked on fake runtimes with known
costs; the CLI end to end on the CPU with llama-tiny, A = B (the A/A run)."""

import json

import numpy as np
import pytest

from ort_triton.bench import ab, decoder


class FakeModel:
    """What compare_decoder reads of a decoder.Model: the position table and the feeds."""

    def positions(self):
        return 64

    def feeds(self, phase, batch, n, seed=0):
        return {"input_ids": np.zeros((batch, n if phase == "prefill" else 1), np.int64)}


class FakeRuntime:
    """A bench.decoder runtime whose every call 'takes' cost (ms) plus a drift that grows with each call of
    either runtime; `fails` names the phase whose runner it cannot make."""

    calls = []

    def __init__(self, name, cost, fails=None):
        self.name, self.cost, self.fails = name, cost, fails

    def runner(self, m, feeds):
        phase = "prefill" if feeds["input_ids"].shape[1] > 1 else "decode"
        if phase == self.fails:
            raise RuntimeError(f"no {phase} here")

        def run():
            FakeRuntime.calls.append(self.name)
            return self.cost + 0.001 * len(FakeRuntime.calls)

        run.logits = lambda: np.full((feeds["input_ids"].shape[0], 1, 8), self.cost, np.float32)
        return run


class CostClock:
    def time(self, fn):
        return fn()


@pytest.mark.parametrize("phase, n", [("prefill", 16), ("decode", 32)])
def test_speedup_is_a_over_b_and_rounds_alternate(phase, n):
    FakeRuntime.calls = []
    a, b = FakeRuntime("slow", 2.0), FakeRuntime("fast", 1.0)
    row = ab.compare_decoder(a, b, FakeModel(), phase, 4, n, CostClock(), rounds=4, iters=3, warmup=1)
    assert row["status"] == "ok" and (row["phase"], row["batch"], row["length"]) == (phase, 4, n)
    assert (row["seq"], row["past"]) == ((n, 0) if phase == "prefill" else (1, n))
    assert (row["a"], row["b"], row["rounds"], row["iters"]) == ("slow", "fast", 4, 3)
    assert row["speedup"] == pytest.approx(2.0, rel=0.01) and row["ratio_min"] <= row["speedup"] <= row["ratio_max"]
    assert row["a_ms"] > row["b_ms"] > 0 and len(row["a_round_ms"]) == len(row["b_round_ms"]) == 4
    assert row["max_abs_diff_b_vs_a"] == pytest.approx(1.0)
    timed = FakeRuntime.calls[2:2 + 4 * 6]  # after one warm-up call each; the logits calls come last
    assert [timed[k * 6] for k in range(4)] == ["slow", "fast", "slow", "fast"]  # the order flips every round
    assert all(len(set(timed[k * 6:k * 6 + 3])) == 1 for k in range(4))  # iters calls of one, then the other


def test_what_a_runtime_cannot_run_is_a_row():
    a, b = FakeRuntime("a", 1.0), FakeRuntime("b", 1.0, fails="decode")
    m, clock = FakeModel(), CostClock()
    row = ab.compare_decoder(a, b, m, "decode", 1, 16, clock, rounds=2, iters=2, warmup=1)
    assert row["status"] == "error" and "B (b) cannot run decode 1x16: RuntimeError: no decode here" in row["error"]
    assert "speedup" not in row and (row["phase"], row["batch"], row["length"]) == ("decode", 1, 16)
    row = ab.compare_decoder(a, b, m, "decode", 1, 64, clock, rounds=2, iters=2, warmup=1)  # needs 65 positions
    assert row["status"] == "skipped" and "65 positions > the model's 64" in row["error"]
    ok = ab.compare_decoder(a, b, m, "prefill", 1, 16, clock, rounds=2, iters=2, warmup=1)
    total = ab.summary([row, ok, dict(ok, speedup=4.0)])  # over the rows that ran
    assert total["rows"] == 2 and total["max"] == 4.0 and total["geomean"] == pytest.approx(2.0 * ok["speedup"] ** 0.5)
    assert ab.summary([row]) is None


def test_cli_arguments_are_checked(capsys):
    for argv, message in (
            (["--decoder", "llama-tiny", "--a", "no_such_runtime"], "unknown runtime 'no_such_runtime'"),
            (["--decoder", "llama-tiny", "--b", "ort_triton+no_such_rule"], "unknown rule(s) ['no_such_rule']"),
            (["--decoder", "no_such_model"], "unknown decoder"),
            (["--decoder", "llama-tiny", "--shapes", "1x16"], "with --decoder give --prefill and --decode"),
            (["--decoder", "llama-tiny", "--prefill", "", "--decode", ""], "no shapes"),
            (["--decoder", "llama-tiny", "--dtype", "bfloat16"], "--dtype for decoders"),
            (["--hf-config", "bert-tiny", "--prefill", "1x16"], "go with --decoder")):
        with pytest.raises(SystemExit):
            ab.main(argv + ["--device", "cpu"])
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_runtime_that_cannot_run_here_gives_skipped_rows(tmp_path, capsys):
    out = tmp_path / "ab.json"
    rc = ab.main(["--decoder", "llama-tiny", "--dtype", "float32", "--device", "cpu", "--a", "ort_triton",
                  "--b", "ort_triton_tuned_cuda_graph", "--prefill", "1x8", "--decode", "1x8", "--json", str(out)])
    assert rc == 2 and "ort_triton_tuned_cuda_graph cannot run here" in capsys.readouterr().err
    got = json.loads(out.read_text())
    assert got["summary"] is None and [r["phase"] for r in got["rows"]] == ["prefill", "decode"]
    assert "ort_triton_tuned_cuda_graph cannot run here" in got["runtimes"]["error"]
    assert all(r["status"] == "skipped" and "cannot run here" in r["error"] for r in got["rows"])


@pytest.mark.slow
def test_cli_a_a_on_cpu(tmp_path, capsys):
    """A = B on ORT CPU: two live sessions of the same static runtime (one specialised file per shape,
    shared), one prefill, one decode and one too-long decode shape."""
    out, work = tmp_path / "ab.json", tmp_path / "work"
    rc = ab.main(["--decoder", "llama-tiny", "--dtype", "float32", "--device", "cpu", "--a", "ort_triton_static",
                  "--b", "ort_triton_static", "--prefill", "2x9", "--decode", "1x20,1x256", "--rounds", "2",
                  "--iters", "2", "--warmup", "1", "--work", str(work), "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "B/A speedup" in printed and "over 2 of 3 shapes" in printed
    got = json.loads(out.read_text())
    assert (got["model"], got["kind"], got["dtype"]) == ("llama-tiny", "decoder", "float32")
    assert "--decoder llama-tiny" in got["command"] and "rotary" in got["runtimes"]["a"]
    pre, dec, long = got["rows"]
    assert (pre["phase"], pre["batch"], pre["length"], pre["seq"], pre["past"]) == ("prefill", 2, 9, 9, 0)
    assert (dec["phase"], dec["batch"], dec["length"], dec["seq"], dec["past"]) == ("decode", 1, 20, 1, 20)
    for r in (pre, dec):
        assert r["status"] == "ok" and (r["a"], r["b"]) == ("ort_triton_static", "ort_triton_static")
        assert (r["rounds"], r["iters"]) == (2, 2) and len(r["a_round_ms"]) == len(r["b_round_ms"]) == 2
        assert r["a_ms"] > 0 and r["b_ms"] > 0 and r["ratio_min"] <= r["speedup"] <= r["ratio_max"]
        assert r["max_abs_diff_b_vs_a"] < 1e-5  # the same model, the same feeds
    assert long["status"] == "skipped" and "257 positions > the model's 256" in long["error"]
    s = got["summary"]
    assert s["rows"] == 2 and s["min"] == min(pre["speedup"], dec["speedup"]) <= s["geomean"] <= s["max"]
    fused = decoder.ALL["ort_triton_static"]().key()  # the fused model's name: its rules' digest
    static = sorted(p.name for p in work.glob(f"*.{fused}_static.*.onnx"))
    assert static == [f"llama-tiny.float32.{fused}_static.1x1x21.onnx", f"llama-tiny.float32.{fused}_static.2x9x9.onnx"]


def test_a_started_runtime_is_stopped_when_b_fails_to_start(monkeypatch):
    """B's start raises after A's has succeeded: A's sessions are stopped, and every row says why."""
    from ort_triton.bench import decoder

    events = []

    class Lifecycle:
        name, info = "fine", "a info"

        def available(self, m):
            return None

        def start(self, m):
            events.append(f"start {self.name}")

        def stop(self):
            events.append(f"stop {self.name}")

    class Broken(Lifecycle):
        name = "broken"

        def start(self, m):
            raise RuntimeError("no session")

    monkeypatch.setattr(decoder, "Model", lambda *args: FakeModel())
    monkeypatch.setattr(decoder, "ALL", {"fine": Lifecycle, "broken": Broken})
    rows, info = ab.bench_decoder("llama-tiny", "fine", "broken", [(1, 8)], [(1, 8)], device="cpu")
    assert events == ["start fine", "stop fine"]
    assert "broken failed to start: RuntimeError: no session" in info["error"]
    assert [r["status"] for r in rows] == ["error", "error"]
