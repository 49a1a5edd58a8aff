"""bench/soak.py (what a long run's processes hold) and bench/delay_proxy.py (a slow link)."""

import os
import socket
import subprocess
import sys
import threading
import time

from bench import delay_proxy
from bench import soak

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tree_and_roles_follow_the_parents():
    table = {10: (1, 0, "python -m polybeast"),
             11: (10, 0, "python -m polybeast_env --env CartPole-v1"),
             12: (11, 0, "python -c from multiprocessing.spawn import spawn_main"),
             13: (10, 0, "python -c from multiprocessing.resource_tracker import main"),
             14: (10, 0, "python -c from multiprocessing.spawn import spawn_main"),
             20: (1, 0, "unrelated")}
    assert sorted(soak.tree(10, table)) == [10, 11, 12, 13, 14]
    roles = {pid: soak.role(pid, 10, table, "polybeast") for pid in soak.tree(10, table)}
    assert roles == {10: "learner", 11: "polybeast_env", 12: "env_server",
                     13: "resource_tracker", 14: "acting"}
    assert soak.role(14, 10, table, "monobeast") == "actor"


def test_watch_samples_a_real_tree_and_finds_what_it_left(tmp_path):
    # A parent that starts a child which outlives it, in a new session: a leftover.
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
              "start_new_session=True); time.sleep(2)")
    parent = subprocess.Popen([sys.executable, "-c", script])
    watch = soak.Watch(parent.pid, "monobeast", str(tmp_path / "resources.csv"))
    try:
        deadline = time.monotonic() + 30
        while len(soak.tree(parent.pid, soak.process_table())) < 2:
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        watch.sample()
        parent.wait(30)
        (tmp_path / "tmp").mkdir()
        (tmp_path / "tmp" / "left.sock").write_text("")
        (tmp_path / "tmp" / "torchinductor_root").mkdir()  # torch's cache: not ours
        left = watch.leftovers(str(tmp_path / "tmp"))
    finally:
        watch.file.close()
        for pid in watch.seen:
            if pid != parent.pid:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
    assert len(left["processes"]) == 1 and "time.sleep(60)" in left["processes"][0]
    assert left["files in $TMPDIR"] == ["left.sock"]
    rows = soak.read_rows(str(tmp_path))
    assert {r["role"] for r in rows} == {"learner", "actor"}
    assert all(r["rss_mb"] > 1 and r["fds"] >= 3 and r["threads"] >= 1 for r in rows)


def test_growth_compares_the_end_with_the_baseline():
    rows = []
    for minute in range(12):
        for pid, rss in ((1, 100.0), (2, 100.0 + 10 * (minute >= 8))):
            rows.append({"time": str(minute * 60), "minute": float(minute), "pid": str(pid),
                         "role": "actor", "rss_mb": rss, "fds": 20.0, "threads": 4.0})
    series = soak.per_sample(rows)
    table = soak.growth_table(series, soak.processes_per_sample(rows), 5, 3)
    rss = next(line for line in table if "rss_mb" in line).split("|")
    # Per process: 100 at minutes 5-6, (100 + 110) / 2 over the last three samples.
    assert [c.strip() for c in rss[2:8]] == ["2", "rss_mb", "100.0", "105.0", "105.0", "1.050"]


def echo_server():
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        connection, _ = listener.accept()
        with connection:
            while data := connection.recv(1 << 16):
                connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_delay_proxy_adds_the_round_trip_and_keeps_the_bytes():
    listener = echo_server()
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = subprocess.Popen([sys.executable, "-m", "bench.delay_proxy", "--listen",
                              f"127.0.0.1:{port}", "--to", target, "--rtt_ms", "300"],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "listening"
        payload = os.urandom(1 << 20)  # many chunks, which must arrive in order
        with socket.create_connection(("127.0.0.1", port)) as client:
            start = time.monotonic()
            client.sendall(b"x")
            assert client.recv(1) == b"x"
            assert time.monotonic() - start >= 0.3  # the round trip was added
            threading.Thread(target=client.sendall, args=(payload,), daemon=True).start()
            received = b""
            while len(received) < len(payload):
                received += client.recv(1 << 16)
        assert received == payload
    finally:
        proxy.terminate()
        proxy.wait(10)
        listener.close()


def test_delay_proxy_refuses_lists_of_different_lengths():
    try:
        delay_proxy.main(["--listen", "127.0.0.1:1,127.0.0.1:2", "--to", "127.0.0.1:3"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("accepted two listening addresses for one target")
