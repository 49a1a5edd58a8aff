"""Fixtures that several test files share."""

import errno
import os
import signal
import subprocess
import tempfile
import time

# The slow tier's workers share the cores with the processes their tests start (learners,
# actors, env servers), so a core is rarely free. An OpenMP thread that spins waiting for its
# peer then holds each parallel op (tanh, softmax, ...) up for a whole scheduler slice while
# the peer waits for a core: a serial-mode run slowed to a crawl. Passive waiting gives the
# core back at once; it changes the speed only. Children inherit it, and this process reads
# it when torch (below) loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Some tests talk to our servers through grpcio, Python's gRPC (an independent client and
# TorchBeast's reference server), and later tests fork in the same process: MonoBeast's actor
# processes, ffmpeg under imageio. None of those children uses gRPC, but grpcio's core runs
# its fork handlers in each of them unless this is off, and they then break file descriptors
# under its pollers ("epoll_wait error: Bad file descriptor"): once a video test's ffmpeg
# gave imageio no header, only that error on its stderr, and the test failed. grpcio reads
# this when it first starts, so it is set here, before any test.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"


def run_until(command, done, timeout, **popen_args):
    """Runs `command` until it ends or `done()` holds (asked every half second), then stops it
    with SIGTERM, as a user who has seen enough does; returns its CompletedProcess (stderr
    only). A learning test stops its run once the run has learned: the steps after that would
    check nothing more. After `timeout` seconds the run is stopped all the same."""
    with tempfile.TemporaryFile("w+") as stderr:  # a pipe that nobody reads could fill up
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                   **popen_args)
        try:
            deadline = time.monotonic() + timeout
            while process.poll() is None and not done() and time.monotonic() < deadline:
                time.sleep(0.5)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, "", stderr.read())


@pytest.fixture(name="run_until")
def run_until_fixture():
    """run_until (above), for the tests."""
    return run_until


@pytest.fixture
def keep_process_state():
    """train() installs signal handlers and sets torch's thread count: put them back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    torch.set_num_threads(threads)


class SmallDisk:
    """A 2 MB tmpfs at `path` that a test can fill up (fill) and free again (free)."""

    def __init__(self, path):
        self.path = path

    def fill(self):
        with open(os.path.join(self.path, "filler"), "ab", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e

    def free(self):
        os.remove(os.path.join(self.path, "filler"))


@pytest.fixture
def small_disk(tmp_path):
    """A full disk on demand: a small tmpfs mounted for the test (it needs root, which CI
    has; elsewhere the test is skipped) and unmounted after it, passed or failed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = str(tmp_path / "disk")
    os.mkdir(path)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", path],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield SmallDisk(path)
    finally:
        # Lazy: a process of the test that still holds a file there cannot keep it mounted.
        subprocess.run(["umount", "-l", path], capture_output=True)
