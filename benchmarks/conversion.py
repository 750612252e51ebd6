"""Conversion benchmark: how long make_equivariant takes, and what it does to parameter counts.

For every (model, group) pair a fresh worker process is started with
EQUICONVERT_CACHE_DIR pointing at a new, empty temporary directory, so that the
first conversion is truly cold: no basis on disk, none in memory, escnn not yet
imported and its own (joblib / in-process) caches empty. The worker then

1. builds the model (timed separately; never part of a conversion time),
2. imports escnn (timed separately, `escnn_import_s`),
3. converts once with the default width: `cold_s` (escnn builds every basis and
   writes it to disk); `cold_with_import_s` adds the import,
4. converts `--repeats` times with the memory cache cleared before each run
   (bases are loaded from disk): `warm_disk_s`, median reported,
5. converts `--repeats` times keeping the memory cache: `warm_memory_s`, median,
6. converts once per width policy (kappa 1.75 = default, kappa 1.5 = the paper's
   released code, "channels", "params") and records parameter counts and times.
   width="params" bisects the multiplier with ~20 meta-device conversions; when it
   misses the 2% tolerance make_equivariant raises, and the numbers from the error
   are recorded (status "outside_tolerance"), nothing is skipped.

The equiconvert sources are copied to a temporary snapshot when the run starts
and every worker imports that copy (`--no-snapshot` to use the live tree), so
edits made to the repository during a long run cannot mix library versions; the
header records the snapshot's hash and whether the live tree changed meanwhile.

Results go to a JSON file (header + one record per (model, group)); a compact
Markdown table is printed to stdout, progress to stderr.

    PYTHONPATH=. .venv/bin/python benchmarks/conversion.py            # full run
    PYTHONPATH=. .venv/bin/python benchmarks/conversion.py --quick    # resnet18 + resnet9, D4 and O2
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = HERE / "results" / "conversion.json"

# name -> (registry name for equiconvert.models.create_model, make_equivariant keyword arguments)
MODELS: dict[str, tuple[str, dict]] = {
    "tv_resnet18": ("torchvision:resnet18", {}),
    "tv_resnet50": ("torchvision:resnet50", {}),
    "tv_wide_resnet50_2": ("torchvision:wide_resnet50_2", {}),
    "tv_vgg11_bn": ("torchvision:vgg11_bn", {"head": "invariant"}),
    "tv_densenet121": ("torchvision:densenet121", {}),
    "tv_mobilenet_v2": ("torchvision:mobilenet_v2", {}),
    "timm_resnet18": ("timm:resnet18", {}),
    "timm_resnet50d": ("timm:resnet50d", {}),
    "ec_resnet9": ("equiconvert:resnet9", {"head": "invariant"}),
}


def _aliases() -> dict[str, str]:
    """Registry names and bare names -> benchmark names; for a bare name the first source listed wins, as in the
    registry ("resnet18": torchvision's)."""
    aliases: dict[str, str] = {}
    for key, (spec, _) in MODELS.items():
        aliases[spec] = key
        aliases.setdefault(spec.partition(":")[2], key)
    return aliases


ALIASES = _aliases()
QUICK_MODELS = ["tv_resnet18", "ec_resnet9"]
NUM_CLASSES = 10
# width label -> value passed as make_equivariant(width=...)
WIDTHS: dict[str, object] = {"kappa=1.75 (default)": None, "kappa=1.5": 1.5, "channels": "channels", "params": "params"}
TARGET = {"model": "tv_resnet50", "group": "D4", "limit_s": 10.0, "measure": "warm_disk_s"}
FIRST_SIZES = 8


# ----------------------------------------------------------------------------- worker
def _source(name: str) -> str:
    return MODELS[name][0].partition(":")[0]


def _build_model(name: str):
    from equiconvert.models import create_model

    return create_model(MODELS[name][0], num_classes=NUM_CLASSES)


def _timed(fn):
    """(wall seconds, CPU seconds of this process over all its threads, result)."""
    start, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - start, time.process_time() - cpu, value


def _summary(runs: list[float]) -> dict:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc(limit=-4)}


_PARAMS_MISS = re.compile(r"reached ([\d,]+) parameters for a target of ([\d,]+)")


def _worker(args: argparse.Namespace) -> int:
    cache_dir = Path(args.cache_dir)
    os.environ["EQUICONVERT_CACHE_DIR"] = str(cache_dir)  # before anything computes the cache path
    record: dict = {"model": args.model, "group": args.group, "status": "ok"}
    try:
        import torch

        from equiconvert import make_equivariant
        from equiconvert._escnn_compat import import_escnn
        from equiconvert.basis import basis_dir, clear_memory_cache
        from equiconvert.cache import cache_root

        assert cache_root() == cache_dir, (cache_root(), cache_dir)
        assert not any(cache_dir.iterdir()), "cold run needs an empty cache directory"
        assert "escnn" not in sys.modules
        import equiconvert

        record["equiconvert_file"] = equiconvert.__file__
        kwargs = MODELS[args.model][1]
        record.update(source=_source(args.model), kwargs=kwargs, torch_threads=torch.get_num_threads())

        record["build_s"], _, model = _timed(lambda: _build_model(args.model))
        record["params_before"] = sum(p.numel() for p in model.parameters())

        group, _, frequency = args.group.partition("@")  # "O2@2": O(2) fields band-limited at frequency 2

        def convert(width=None):
            return make_equivariant(
                model, group, width=width, frequency=int(frequency) if frequency else None, **kwargs
            )

        # escnn import is separated out so cold_s is the basis building + conversion itself
        record["escnn_import_s"], _, _ = _timed(import_escnn)
        clear_memory_cache()
        record["cold_s"], record["cold_cpu_s"], converted = _timed(convert)
        record["cold_with_import_s"] = record["escnn_import_s"] + record["cold_s"]
        bases = sorted(p.name for p in basis_dir().glob("*.pt"))
        record["bases_built"] = bases
        record["basis_cache_bytes"] = sum(p.stat().st_size for p in basis_dir().glob("*.pt"))

        disk_runs, disk_cpu = [], []
        for _ in range(args.repeats):
            clear_memory_cache()  # bases come from the disk cache written by the cold run
            seconds, cpu, converted = _timed(convert)
            disk_runs.append(seconds)
            disk_cpu.append(cpu)
        record["warm_disk_s"], record["warm_disk_cpu_s"] = _summary(disk_runs), _summary(disk_cpu)
        memory_runs, memory_cpu = [], []
        for _ in range(args.repeats):  # memory cache kept: no basis I/O at all
            seconds, cpu, converted = _timed(convert)
            memory_runs.append(seconds)
            memory_cpu.append(cpu)
        record["warm_memory_s"], record["warm_memory_cpu_s"] = _summary(memory_runs), _summary(memory_cpu)
        if sorted(p.name for p in basis_dir().glob("*.pt")) != bases:
            record["note_cache"] = "warm runs wrote new bases to disk (unexpected)"

        report = converted.report
        record.update(
            valid_input_rule=report.valid_input_rule,
            first_valid_sizes=report.valid_input_sizes[:FIRST_SIZES],
            num_valid_sizes_up_to_1024=len(report.valid_input_sizes),
            invariant_output=report.invariant_output,
            num_warnings=len(report.warnings),
            warnings=[str(w) for w in report.warnings][:10],
            layers_changed=len(report.layers),
        )
        del converted

        widths: dict[str, dict] = {}
        for label, width in WIDTHS.items():
            if label not in args.widths:
                continue
            entry: dict = {"width_arg": width}
            try:
                seconds, cpu, converted = _timed(lambda: convert(width))
                entry.update(
                    status="ok",
                    time_s=seconds,
                    cpu_s=cpu,
                    width_name=converted.report.width,
                    params_after=converted.report.params_after,
                )
                del converted
            except Exception as exc:  # noqa: BLE001 - recorded, not hidden
                entry.update(status="error", error=_error(exc))
                match = _PARAMS_MISS.search(str(exc))
                if width == "params" and match:
                    entry.update(status="outside_tolerance", params_after=int(match[1].replace(",", "")))
                entry["time_s"] = None
            if entry.get("params_after") is not None:
                entry["ratio"] = entry["params_after"] / record["params_before"]
                entry["rel_diff"] = entry["ratio"] - 1.0
                if width == "params":
                    entry["within_2pct"] = abs(entry["rel_diff"]) <= 0.02
            widths[label] = entry
        record["widths"] = widths
        if "params" in widths:
            record["params_time_s"] = widths["params"].get("time_s")
            record["params_cpu_s"] = widths["params"].get("cpu_s")
    except Exception as exc:  # noqa: BLE001
        record.update(status="error", error=_error(exc))
    Path(args.result).write_text(json.dumps(record, indent=1, default=str))
    return 0


# ----------------------------------------------------------------------------- driver
def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _equiconvert_version() -> str | None:
    try:
        import equiconvert

        return equiconvert.__version__
    except ImportError:
        return None


def _git() -> dict:
    def run(*cmd):
        out = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True)
        return out.stdout.rstrip("\n") if out.returncode == 0 else None

    status = run("status", "--porcelain", "--", "equiconvert")
    return {
        "commit": run("rev-parse", "HEAD"),
        "equiconvert_dirty": bool(status) if status is not None else None,
        "equiconvert_changes": status.splitlines() if status else [],
    }


def _source_hash(package: Path) -> str:
    """sha256 over the package's .py files (path and content), to pin the code that was measured."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _snapshot(package: Path) -> Path:
    root = Path(tempfile.mkdtemp(prefix="equiconvert-bench-src-"))
    shutil.copytree(package, root / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _machine() -> dict:
    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torchvision": _version("torchvision"),
        "timm": _version("timm"),
        "escnn": _version("escnn"),
        "equiconvert": _equiconvert_version(),
    }


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _run_worker(model: str, group: str, args: argparse.Namespace, src: Path) -> dict:
    cache_dir = Path(tempfile.mkdtemp(prefix=f"equiconvert-bench-{model}-{group}-"))
    result = cache_dir.parent / (cache_dir.name + ".json")
    env = dict(os.environ, EQUICONVERT_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), str(REPO), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_worker",
        "--model",
        model,
        "--group",
        group,
        "--cache-dir",
        str(cache_dir),
        "--result",
        str(result),
        "--repeats",
        str(args.repeats),
        "--widths",
        ",".join(args.widths),
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if result.exists():
            record = json.loads(result.read_text())
        else:
            record = {
                "model": model,
                "group": group,
                "status": "error",
                "error": {
                    "type": "WorkerDied",
                    "message": f"exit code {proc.returncode}",
                    "stderr_tail": proc.stderr[-3000:],
                },
            }
    except subprocess.TimeoutExpired:
        record = {
            "model": model,
            "group": group,
            "status": "error",
            "error": {"type": "Timeout", "message": f"worker ran past --timeout {args.timeout} s"},
        }
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        result.unlink(missing_ok=True)
    record["worker_wall_s"] = time.perf_counter() - start
    record["loadavg_after"] = _loadavg()
    return record


def _fmt_params(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}M"


def _fmt_width(record: dict, label: str) -> str:
    entry = record.get("widths", {}).get(label)
    if not entry:
        return "-"
    if entry.get("params_after") is None:
        return f"ERR {entry.get('error', {}).get('type', '')}"
    text = f"{_fmt_params(entry['params_after'])} (x{entry['ratio']:.2f})"
    if label == "params":
        text = f"{_fmt_params(entry['params_after'])} ({100 * entry['rel_diff']:+.1f}%)"
        if entry["status"] != "ok":
            text += " MISS"
    return text


def _sec(value, cpu=None) -> str:
    if isinstance(value, dict):
        value = value.get("median")
    if isinstance(cpu, dict):
        cpu = cpu.get("median")
    text = "-" if value is None else f"{value:.2f}"
    return text if cpu is None else f"{text} ({cpu:.2f})"


def markdown_table(records: list[dict]) -> str:
    head = [
        "model",
        "group",
        "cold s",
        "warm disk s",
        "warm mem s",
        "params before",
        "kappa 1.75",
        "kappa 1.5",
        "channels",
        "params",
        "params s",
        "valid sizes",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        if r.get("status") != "ok":
            why = r.get("reason") or f"{r.get('error', {}).get('type')}: {r.get('error', {}).get('message', '')}"
            cells = [r["model"], r["group"], f"{r.get('status', '').upper()}: {why[:120]}"] + [""] * (len(head) - 3)
        else:
            sizes = ", ".join(map(str, r["first_valid_sizes"][:4])) + (
                ", ..." if len(r["first_valid_sizes"]) > 4 else ""
            )
            cells = (
                [
                    r["model"],
                    r["group"],
                    _sec(r["cold_s"], r.get("cold_cpu_s")),
                    _sec(r["warm_disk_s"], r.get("warm_disk_cpu_s")),
                    _sec(r["warm_memory_s"], r.get("warm_memory_cpu_s")),
                    _fmt_params(r["params_before"]),
                ]
                + [_fmt_width(r, label) for label in WIDTHS]
                + [_sec(r.get("params_time_s"), r.get("params_cpu_s")), sizes or "none"]
            )
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def _resolve_models(text: str | None, quick: bool) -> list[str]:
    if not text:
        return list(QUICK_MODELS if quick else MODELS)
    names = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        name = ALIASES.get(name, name)
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)} (aliases: {', '.join(ALIASES)})")
        names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON result file (default {DEFAULT_OUT.relative_to(REPO)})"
    )
    parser.add_argument(
        "--groups",
        default=None,
        help="comma list of groups, NAME@FREQUENCY for SO2/O2 band limits (default D4,C4,O2,SO2; --quick: D4,O2)",
    )
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"small subset: {', '.join(QUICK_MODELS)} on D4 and O2")
    parser.add_argument("--repeats", type=int, default=3, help="warm repetitions, median reported (default 3)")
    parser.add_argument("--widths", default=",".join(WIDTHS), help="comma list of width policies to measure")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (model, group) worker")
    parser.add_argument(
        "--no-snapshot",
        action="store_true",
        help="workers import the live equiconvert/ instead of a copy taken at start",
    )
    # internal: one (model, group) measurement in a fresh process
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.widths = (
        [w.strip() for w in args.widths.split(",") if w.strip()] if isinstance(args.widths, str) else args.widths
    )
    unknown = set(args.widths) - set(WIDTHS)
    if unknown:
        parser.error(f"unknown widths {sorted(unknown)}; known: {list(WIDTHS)}")
    if args._worker:
        return _worker(args)
    if str(REPO) not in sys.path:  # the driver reads equiconvert's version; workers get PYTHONPATH themselves
        sys.path.insert(0, str(REPO))

    models = _resolve_models(args.models, args.quick)
    groups = [
        g.strip().upper() for g in (args.groups or ("D4,O2" if args.quick else "D4,C4,O2,SO2")).split(",") if g.strip()
    ]
    timm_missing = _version("timm") is None
    package = REPO / "equiconvert"
    live_hash_start = _source_hash(package)
    src = REPO if args.no_snapshot else _snapshot(package)
    if not args.no_snapshot and _source_hash(src / "equiconvert") != live_hash_start:
        print("warning: equiconvert/ changed while it was being copied; results may mix versions", file=sys.stderr)
    header = {
        "benchmark": "conversion",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "git": _git(),
        "equiconvert_source": {"sha256": _source_hash(src / "equiconvert"), "snapshot": not args.no_snapshot},
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "num_classes": NUM_CLASSES,
        "repeats": args.repeats,
        "loadavg_before": _loadavg(),
        "definitions": {
            "build_s": "model construction, excluded from every conversion time",
            "escnn_import_s": "import_escnn() in the fresh worker, excluded from cold_s",
            "cold_s": "first make_equivariant (default width) with an empty EQUICONVERT_CACHE_DIR in a fresh process",
            "warm_disk_s": "make_equivariant after clear_memory_cache(): every basis loaded from the disk cache",
            "warm_memory_s": "make_equivariant with the in-memory basis cache kept",
            "widths": "one make_equivariant per width policy (memory cache warm); ratio = params_after / params_before",
            "params_time_s": "make_equivariant(width='params'), including its ~20 meta-device bisection conversions",
            "*_cpu_s": "CPU time (time.process_time, all threads) of the same call: less sensitive to other load than wall time",
        },
    }
    records = []
    started = time.perf_counter()
    for model in models:
        for group in groups:
            if _source(model) == "timm" and timm_missing:
                records.append({"model": model, "group": group, "status": "skipped", "reason": "timm is not installed"})
                continue
            print(f"[{time.perf_counter() - started:7.1f}s] {model} {group} ...", file=sys.stderr, flush=True)
            record = _run_worker(model, group, args, src)
            records.append(record)
            line = f"  {record['status']} in {record['worker_wall_s']:.1f}s"
            if record["status"] == "ok":
                line += f" (cold {_sec(record['cold_s'])}, warm disk {_sec(record['warm_disk_s'])}, params {_sec(record.get('params_time_s'))})"
            else:
                line += f": {record.get('error', {}).get('message', '')[:200]}"
            print(line, file=sys.stderr, flush=True)

    header["total_runtime_s"] = time.perf_counter() - started
    live_changed = _source_hash(package) != live_hash_start
    header["equiconvert_source"]["live_tree_changed_during_run"] = live_changed
    if live_changed:
        print(
            "note: equiconvert/ was edited during the run"
            + ("; measured the snapshot taken at start" if not args.no_snapshot else "; results may mix versions"),
            file=sys.stderr,
        )
    if not args.no_snapshot:
        shutil.rmtree(src, ignore_errors=True)
    header["loadavg_after"] = _loadavg()
    target_record = next((r for r in records if r["model"] == TARGET["model"] and r["group"] == TARGET["group"]), None)
    target = dict(TARGET, description="resnet50 -> D4 in under 10 s warm on the 2-core machine")
    if target_record and target_record.get("status") == "ok":
        measured = target_record[TARGET["measure"]]["median"]
        target.update(
            measured_s=measured,
            passed=measured < TARGET["limit_s"],
            warm_memory_s=target_record["warm_memory_s"]["median"],
            passed_warm_memory=target_record["warm_memory_s"]["median"] < TARGET["limit_s"],
            cold_s=target_record["cold_s"],
            cpu_count=os.cpu_count(),
            warm_disk_cpu_s=target_record["warm_disk_cpu_s"]["median"],
            loadavg_after_record=target_record.get("loadavg_after"),
        )
    else:
        target.update(measured_s=None, passed=None, note="not measured in this run")
    header["target_check"] = target

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"header": header, "records": records}, indent=1, default=str) + "\n")
    print(markdown_table(records))
    print(
        "\nTimes: wall-clock seconds (CPU seconds of the worker process, all threads); warm columns are medians "
        f"of {args.repeats} runs. Parameter columns: count after conversion (x ratio to before); params: relative miss."
    )
    print()
    if target["passed"] is not None:
        print(
            f"target: {target['description']}: {'PASS' if target['passed'] else 'FAIL'} "
            f"(warm disk median {target['measured_s']:.2f} s, warm memory median {target['warm_memory_s']:.2f} s, "
            f"{os.cpu_count()} CPUs)"
        )
    print(f"total runtime {header['total_runtime_s']:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
