"""The scripts in examples/ run with their tiny defaults and print what they promise."""

from __future__ import annotations

import math
import re
import subprocess
import sys

from tests.support.paths import REPO_ROOT, repo_env

NUMBER = r"([-+0-9.eE]+|nan|inf)"


def run_example(name: str, *args: str) -> str:
    """Run examples/<name> in a fresh interpreter; returns its stdout (fails on a non-zero exit)."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=repo_env(),
        timeout=300,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def number_after(label: str, text: str) -> float:
    """The number printed right after `label` (a regular expression) in `text`."""
    match = re.search(label + r"\s*" + NUMBER, text)
    assert match, f"no {label!r} in:\n{text}"
    return float(match.group(1))


def test_convert_and_check():
    out = run_example("convert_and_check.py")
    assert number_after("parameters before:", out.replace(",", "")) == 11_181_642  # torchvision resnet18, 10 classes
    assert number_after("parameters after:", out.replace(",", "")) > 0
    assert "valid input sizes: H = W = 1 mod 32" in out
    assert 0 <= number_after(r"max equivariance error at input size 33:", out) < 1e-4
    assert len(re.findall(r"^\s+rot\S*: ", out, flags=re.M)) == 8  # every element of D4
    assert number_after("max relative difference converted vs exported:", out) < 1e-5
    assert "exported model uses modules from: torch\n" in out  # nothing of equiconvert's left


def test_opacus_one_line():
    out = run_example("opacus_one_line.py")
    assert len(re.findall(r"^epoch 0 step \d+: batch \d+, loss [0-9.]+$", out, flags=re.M)) == 3
    epsilon = number_after("epsilon:", out)
    assert 0 < epsilon < math.inf
    assert "3 steps" in out


def test_opacus_one_line_changes_one_line():
    # the script's only equiconvert call is the marked line
    source = (REPO_ROOT / "examples" / "opacus_one_line.py").read_text()
    calls = [line.strip() for line in source.splitlines() if "equiconvert." in line and "import" not in line]
    assert calls == ['model = equiconvert.make_equivariant(model, group="D4", head="invariant")']
    assert "# THE ONE LINE" in source.split(calls[0])[0].splitlines()[-2]


def test_make_private_pipeline():
    out = run_example("make_private_pipeline.py")
    assert len(re.findall(r"^epoch 0 step \d+: batch \d+, loss [0-9.]+$", out, flags=re.M)) == 3
    assert 0 < number_after("epsilon:", out) < math.inf
    assert "3 steps" in out


def test_make_private_pipeline_is_the_opacus_script_with_its_import_swapped():
    def code(name: str) -> list[str]:
        source = (REPO_ROOT / "examples" / name).read_text()
        return source[source.index('"""', 3) + 3 :].splitlines()  # after the docstring

    changed = [(a, b) for a, b in zip(code("opacus_one_line.py"), code("make_private_pipeline.py")) if a != b]
    assert len(code("opacus_one_line.py")) == len(code("make_private_pipeline.py"))
    assert [(a, b.split("  #")[0]) for a, b in changed] == [
        ("from opacus import PrivacyEngine", "from equiconvert.privacy import PrivacyEngine")
    ]


def test_paper_table1_row():
    out = run_example("paper_table1_row.py")
    row = re.search(r"^\| D4 \| (\S+) \| 256k \| (\S+) .*\| (\S+) \(D2, 32px\) \|$", out, flags=re.M)
    assert row, out
    assert int(row.group(1).replace(",", "")) == 255_675
    assert abs(float(row.group(2).rstrip("%"))) < 0.2  # Table 1 prints thousands
    assert 0 <= float(row.group(3)) < 1e-4


def test_train_imagefolder_demo():
    out = run_example("train_imagefolder.py", "--demo-data")
    assert "32 training and 8 test images of 3x32x32, classes ['disk', 'square']" in out
    assert number_after("max equivariance error", out) < 1e-4
    assert 0 < number_after("epsilon", out) <= 8.0
    assert 0.0 <= number_after("test accuracy:", out) <= 1.0


def test_finetune_from_checkpoint_trains_saves_and_reloads():
    out = run_example("finetune_from_checkpoint.py")
    assert "started from: stand-in" in out
    assert 0 < number_after("at epsilon", out) <= 8.0
    changed = re.search(r"parameter tensors changed: (\d+) of (\d+)", out)
    assert changed and int(changed.group(1)) > 0  # the fine-tuning moved the loaded weights
    assert "reloaded model gives identical outputs: True" in out
