"""bench.ab: two runtimes timed in alternating rounds. The direction and the rounds are checked on fake
runtimes with known costs; the CLI end to end on the CPU with bert-tiny."""

import json

import pytest

from ort_triton.bench import ab


class Fake:
    """A runtime whose every call 'takes' cost (ms) plus a drift that grows with each call of either runtime."""

    calls = []

    def __init__(self, name, cost):
        self.name, self.cost = name, cost

    def prepare(self, model, shape, inputs):
        fake = self

        class Runner:
            closed = False

            def run(self):
                Fake.calls.append(fake.name)
                return fake.cost + 0.001 * len(Fake.calls)

            def close(self):
                self.closed = True
                fake.closed = True

        return Runner()


class CostClock:
    def time(self, fn):
        return fn()


def test_speedup_is_a_over_b_and_rounds_alternate():
    Fake.calls = []
    a, b = Fake("slow", 2.0), Fake("fast", 1.0)
    row = ab.compare(a, b, None, (1, 8), {}, CostClock(), rounds=4, iters=3, warmup=1)
    assert row["speedup"] == pytest.approx(2.0, rel=0.01) and row["ratio_min"] <= row["speedup"] <= row["ratio_max"]
    assert len(row["a_round_ms"]) == len(row["b_round_ms"]) == 4
    timed = Fake.calls[2:]  # after one warm-up call each
    firsts = [timed[k * 6] for k in range(4)]
    assert firsts == ["slow", "fast", "slow", "fast"]  # the order flips every round
    assert a.closed and b.closed
    assert ab.summary([row, dict(row, speedup=0.5)])["geomean"] == pytest.approx(1.0, rel=0.01)


def test_cli_on_cpu(tmp_path, capsys):
    out = tmp_path / "ab.json"
    rc = ab.main(["--hf-config", "bert-tiny", "--dtype", "float32", "--device", "cpu", "--a", "ort_stock",
                  "--b", "ort_triton", "--shapes", "1x16", "--rounds", "2", "--iters", "2", "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert (row["a"], row["b"], row["batch"], row["seq"]) == ("ort_stock", "ort_triton", 1, 16)
    assert row["a_ms"] > 0 and row["b_ms"] > 0 and got["summary"]["min"] == row["speedup"]
    assert "B/A speedup" in capsys.readouterr().out


def test_cli_refuses_what_cannot_run(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--a", "no_such_runtime", "--device", "cpu"])
    rc = ab.main(["--hf-config", "bert-tiny", "--dtype", "float32", "--device", "cpu", "--a", "ort_stock",
                  "--b", "ort_triton_tuned", "--shapes", "1x16"])
    assert rc == 2 and "ort_triton_tuned cannot run here" in capsys.readouterr().err
