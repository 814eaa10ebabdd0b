"""benchmarks/launch_floor.py on the CPU (Triton's interpreter, tiny shapes): the chains compute what they claim,
and the fit and the step model do their arithmetic."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.launch_floor import TARGET, fit, main, step_model  # noqa: E402


def test_the_chains_give_the_reference_results():
    r = main(["--sizes", "16", "48", "--layers", "3"])
    assert [(row["chain"], row["d"]) for row in r["rows"]] == [("tick", 0), ("tick, no PDL", 0), ("gemv", 16),
                                                                ("gemv", 48)]
    assert all(row["ok"] for row in r["rows"])  # three ticks add three; the GEMVs match the fp32 chain
    assert [row["bytes"] for row in r["rows"]] == [0, 0, 16 * 16 * 4, 48 * 48 * 4]  # fp32 weights on the CPU
    assert "fit" not in r  # no timings without a GPU


def test_the_fit_recovers_a_line_and_refuses_what_is_not_one():
    a, b = fit([(1e6, 2.0 + 1e6 / 2500.0), (4e6, 2.0 + 4e6 / 2500.0), (16e6, 2.0 + 16e6 / 2500.0)])
    assert a == pytest.approx(2.0) and b == pytest.approx(2500.0)
    with pytest.raises(ValueError, match="two sizes"):
        fit([(1e6, 3.0), (1e6, 4.0)])
    with pytest.raises(ValueError, match="does not grow"):
        fit([(1e6, 4.0), (2e6, 3.0)])


def test_the_step_model():
    # 200 kernels at 2 us fixed, 1.5 GB streamed at 2.5e6 bytes/us (2.5 TB/s), roofline 0.5 ms at 3 TB/s
    s = step_model(200, 1.5e9, 3e12, 2.0, 2.5e6)
    assert s["roofline_ms"] == pytest.approx(0.5)
    assert s["stream_us"] == pytest.approx(600.0) and s["fixed_us"] == pytest.approx(400.0)
    assert s["step_us"] == pytest.approx(1000.0) and s["of_roofline"] == pytest.approx(0.5)
    assert s["kernels_for_target"] == int((500.0 / TARGET - 600.0) // 2.0)  # 116: what 60% would leave


def test_a_step_of_another_form_is_refused():
    with pytest.raises(SystemExit, match="KERNELS:MB"):
        main(["--sizes", "16", "--layers", "1", "--step", "229"])


def test_a_run_is_printed_and_drawn_again_from_its_json(tmp_path, capsys):
    rows = [dict(chain="tick", d=0, bytes=0, us=0.7, ok=True),
            dict(chain="tick, no PDL", d=0, bytes=0, us=1.1, ok=True)]
    rows += [dict(chain="gemv", d=d, bytes=2 * d * d, us=1.2 + 2 * d * d / 2.6e6, ok=True, err=0.0)
             for d in (512, 2048, 8192)]
    run = dict(device="a GPU", bandwidth=2.9e12, rows=rows, layers=24, batch_rows=1,
               fit=dict(a_us=1.2, bytes_per_us=2.6e6))
    path = tmp_path / "run.json"
    path.write_text(__import__("json").dumps(run))
    again = main(["--from-json", str(path), "--plot", str(tmp_path / "floor.png")])
    assert again == run
    assert (tmp_path / "floor.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "t = 1.20 us + bytes / 2600 GB/s" in out and "8192 x 8192" in out
    with pytest.raises(SystemExit, match="no timings"):  # a CPU run has nothing to draw
        main(["--sizes", "16", "--layers", "1", "--plot", str(tmp_path / "none.png")])
