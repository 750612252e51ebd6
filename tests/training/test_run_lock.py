"""One job per output folder, and workers that die with their launcher: real processes, killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from equiconvert.cli import main
from equiconvert.training import worker_lifetime
from equiconvert.training.run_lock import LOCK_FILE, FolderInUseError, hold_run_folder
from equiconvert.training.trainer import DPTrainer
from tests.support.paths import REPO_ROOT
from tests.support.tiny import linear_classifier, tiny_images
from tests.support.train_args import tiny_train_args

OPTIONS = dict(noise_multiplier=1.0, target_epsilon=None, batch_size=8, steps=1, aug_mult=1, ema_decay=None)
OPTIONS.update(augment_padding=0, augment_flip=False, progress=False)

HOLD = """
import sys, time
from pathlib import Path
from equiconvert.training.run_lock import hold_run_folder
with hold_run_folder(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def _started(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -c code args` with this checkout importable, its stdout piped."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


def _thread_states(pid: int) -> list[str]:
    """The scheduler state of every thread of process `pid` (empty once it is reaped)."""
    states = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # this thread ended while the others were read
    return states


def _gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` has ended within `within_s` seconds: reaped, or every thread a zombie.

    The main thread of a killed process can be a zombie while its other threads still exit and hold its open
    files (a folder lock among them), so every thread is checked."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(state in ("Z", "X") for state in _thread_states(pid)):
            return True
        time.sleep(0.05)
    return False


def test_a_second_job_is_refused_while_the_first_lives_and_allowed_after_it_is_killed(tmp_path, capsys):
    out = tmp_path / "run"
    holder = _started(HOLD, str(out))
    try:
        assert holder.stdout.readline().strip() == "held"
        expected = rf"^{out} is in use by another training job \(pid {holder.pid}\): wait for it to end, stop it"
        with pytest.raises(FolderInUseError, match=expected):
            DPTrainer(linear_classifier(), out_dir=out, **OPTIONS).fit(tiny_images())
        assert main(tiny_train_args(out)) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"error: {out} is in use by another training job (pid {holder.pid})")
        assert error.count("\n") == 1 and not (out / "log.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    DPTrainer(linear_classifier(), out_dir=out, **OPTIONS).fit(tiny_images())  # the dead job holds nothing
    assert (out / "log.jsonl").exists()


def test_the_lock_is_reentrant_in_one_process_and_released_after_the_block(tmp_path):
    with hold_run_folder(tmp_path / "run"):
        with hold_run_folder(tmp_path / "run"):  # the command line's run around its trainer
            pass
        assert (tmp_path / "run" / LOCK_FILE).read_text().strip() == str(os.getpid())
    probe = _started(HOLD, str(tmp_path / "run"))  # another process may take it now
    try:
        assert probe.stdout.readline().strip() == "held"
    finally:
        probe.send_signal(signal.SIGKILL)
        probe.wait()
    with hold_run_folder(tmp_path / "missing", create=False):
        assert not (tmp_path / "missing").exists()


# The mechanism alone, loaded from its file: no torch import, so the processes start in a fraction of a second.
LOAD = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("worker_lifetime", {worker_lifetime.__file__!r})
lifetime = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lifetime)
"""
WORKER = (
    LOAD
    + """
import time
lifetime.die_with_parent()
print("alive", flush=True)
time.sleep(120)
"""
)
LAUNCHER = (
    LOAD
    + f"""
import os, subprocess, sys, time
env = {{**os.environ, **lifetime.launcher_environment()}}
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], env=env, start_new_session=True, stdout=subprocess.PIPE)
print(worker.pid, worker.stdout.readline().decode().strip(), flush=True)
time.sleep(120)
"""
)


def test_a_worker_dies_with_its_launcher_killed_by_sigkill():
    launcher = _started(LAUNCHER)
    pid, state = launcher.stdout.readline().split()
    assert state == "alive"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    survived = not _gone(int(pid), within_s=30)  # at once, unless the machine is very busy
    if survived:
        os.kill(int(pid), signal.SIGKILL)
    assert not survived, "the worker outlived its launcher"


def test_a_worker_whose_launcher_died_before_it_started_ends_at_once():
    worker = _started(WORKER, env={worker_lifetime.LAUNCHER_PID: "1"})  # its parent is not pid 1: that one is gone
    stdout, _ = worker.communicate(timeout=60)
    assert worker.returncode == -signal.SIGKILL and "alive" not in stdout
