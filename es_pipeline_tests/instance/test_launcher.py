"""The warm launcher's process checks: a pid given to another process since is not taken for the run."""

from __future__ import annotations

import os
import subprocess

from es_pipeline.instance.launcher import is_same_process, process_start


def test_a_process_is_known_by_its_pid_and_start_time() -> None:
    me = os.getpid()
    start = process_start(me)
    assert start is not None and start.isdigit()
    assert is_same_process(me, start)
    assert is_same_process(me, None)  # no start recorded (older runs): the pid alone
    assert not is_same_process(me, str(int(start) + 1)), "the same pid, another start: another process"


def test_a_finished_process_is_gone() -> None:
    child = subprocess.Popen(["true"])
    start = process_start(child.pid)
    child.wait()
    assert not is_same_process(child.pid, start)
