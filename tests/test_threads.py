"""The CPU thread team follows the cores other processes leave free (ridge/engine/threads.py)."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import torch

from ridge.engine import threads
from ridge.engine.threads import ThreadGovernor, team_size


def test_team_size_is_the_cores_left():
    assert team_size(2, 0.0, 2) == 2
    assert team_size(2, 0.25, 2) == 2  # within the slack: sharing a little beats halving the team
    assert team_size(2, 0.8, 2) == 1
    assert team_size(2, 1.9, 2) == 1  # never below one thread
    assert team_size(16, 4.0, 8) == 8  # never above the configured count
    assert team_size(16, 10.2, 16) == 6


def _tick_for(gov: ThreadGovernor, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        gov.tick()
        time.sleep(0.02)


def test_team_shrinks_beside_a_busy_process_and_only_after_two_samples():
    """The busy process is our own child, as a benchmark's competitor is: still not ridge's work."""
    before = torch.get_num_threads()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        gov = ThreadGovernor(limit=2, cores=2)
        _tick_for(gov, threads.SAMPLE_S * 1.2)  # one sample: a vote, not yet a change
        assert gov.others > 0.6, gov.others
        assert gov.threads == 2
        _tick_for(gov, threads.SAMPLE_S * 1.2)
        assert gov.threads == 1 and torch.get_num_threads() == 1
        _tick_for(gov, threads.SAMPLE_S * 2.5)  # it stays small while the child runs
        assert gov.threads == 1
    finally:
        busy.kill()
        busy.wait(5)
        torch.set_num_threads(before)


def test_own_work_is_not_a_competitor():
    """This process keeping a core busy is subtracted from the machine's load, whatever else runs."""
    before = torch.get_num_threads()
    try:
        me = psutil.Process()
        t0, busy0, own0 = time.monotonic(), threads._busy_seconds(), sum(me.cpu_times()[:2])
        gov = ThreadGovernor(limit=2, cores=2)
        while not gov._samples:
            sum(range(20000))  # our own CPU time: up to a core, less on a loaded machine
            gov.tick()
        wall = time.monotonic() - t0
        machine = (threads._busy_seconds() - busy0) / wall
        own = (sum(me.cpu_times()[:2]) - own0) / wall
        assert own > 0.1
        assert abs(gov.others - (machine - own)) < 0.15, (gov.others, machine, own)
    finally:
        torch.set_num_threads(before)
