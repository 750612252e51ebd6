"""benchmarks/throughput.py runs each filter-gradient kernel it is asked for, and reports what "fastest" chose."""

import json

from tests.support.benchmark_scripts import load_benchmark


def test_kernel_suffixes_run_side_by_side_and_fastest_is_reported(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    methods = "nonprivate,bookkeeping:products,bookkeeping:grouped,bookkeeping:fastest"
    assert (
        load_benchmark("throughput").main(
            [
                "--device",
                "cpu",
                "--widths",
                "4,8,8",
                "--group",
                "C4",
                "--batch",
                "2",
                "--aug-mult",
                "2",
                "--methods",
                methods,
                "--iters",
                "1",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert list(report["results"]) == methods.split(",")
    assert all(record["ms_per_step"] > 0 for record in report["results"].values())
    choices = report["fastest_filter_gradient_kernels"]
    assert choices and set(choices.values()) <= {"products", "grouped", "unfolded"}
    assert all(key.startswith("cpu float32") for key in choices)


def test_make_private_runs_beside_opacus_and_the_nonprivate_step(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    methods = "nonprivate,make_private,opacus"
    assert (
        load_benchmark("throughput").main(
            [
                "--device",
                "cpu",
                "--widths",
                "4,8,8",
                "--group",
                "C4",
                "--batch",
                "2",
                "--aug-mult",
                "2",
                "--methods",
                methods,
                "--iters",
                "1",
                "--warmup",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    results = json.loads(out.read_text())["results"]
    assert list(results) == methods.split(",")
    assert all(record["ms_per_step"] > 0 and record["time_vs_nonprivate"] > 0 for record in results.values())


def test_fuse_norm_pools_fuses_the_paper_models_three_pairs_and_says_so(tmp_path, capsys):
    throughput = load_benchmark("throughput")
    argv = ["--device", "cpu", "--model", "paper", "--batch", "1", "--aug-mult", "1", "--methods", "nonprivate"]
    argv += ["--iters", "1", "--warmup", "0"]
    reports = []
    for extra in ([], ["--fuse-norm-pools"]):
        out = tmp_path / f"throughput{len(extra)}.json"
        assert throughput.main([*argv, *extra, "--out", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert [r["model"]["fused_norm_pools"] for r in reports] == [None, 3]
    assert reports[0]["model"]["params"] == reports[1]["model"]["params"] == 255_675
