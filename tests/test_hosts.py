"""bench/hosts.py: PolyBeast with servers it starts, servers by hand, servers on another host."""

import os
import shutil
import subprocess
import sys

from bench import netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def namespaces():
    if netns.reason() is not None:
        return set()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith(netns.PREFIX)}


def test_every_way_to_reach_the_servers_trains_and_nothing_is_left():
    before = namespaces()
    result = subprocess.run(
        [sys.executable, "-m", "bench.hosts", "--env", "CartPole-v1", "--duration", "3",
         "--windows", "1", "--log_interval_steps", "2560"],
        cwd=REPO, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines()
            if line.startswith("| ") and "SPS" not in line]
    expected = ["local", "this host"]
    if netns.reason() is None:
        expected += ["other host, TCP"]
        if shutil.which("openssl"):
            expected += ["other host, TLS"]
        expected += ["other host, the learner's defaults"]
    cells = [[cell.strip() for cell in row.split("|")[1:4]] for row in rows]
    assert len(cells) == len(expected), result.stdout
    for (label, layout, sps), want in zip(cells, expected):
        assert label.startswith(want), result.stdout
        assert float(sps.replace(",", "")) > 0, result.stdout  # it trained
        # Servers by hand get the local servers' layout, by default too.
        assert layout == cells[0][1], result.stdout
    assert namespaces() == before  # the other host is gone
