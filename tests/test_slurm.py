"""scripts/slurm.sh, run under stand-ins for Slurm's srun and scontrol.

The stand-ins run every task of a step on this machine (SLURM_PROCID set per
task) and name three nodes, all 127.0.0.1: one environment node and two learner
nodes. So the script's own work is tested for real: splitting the nodes,
listing the servers' addresses, starting the servers, and two torchrun learner
ranks that rendezvous, share the servers and train; and that the servers are
stopped when the job ends.
"""

import json
import math
import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from beast import runlog

REPO = pathlib.Path(__file__).resolve().parent.parent

SRUN = textwrap.dedent("""\
    #!{python}
    # srun's stand-in: every task of the step runs here, in its own process group.
    import os, signal, subprocess, sys
    args, opts = sys.argv[1:], {{}}
    while args[0].startswith("--"):
        key, _, value = args.pop(0)[2:].partition("=")
        opts[key] = value
    with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
        log.write(opts["nodelist"] + "\\n")
    tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i)),
                              start_new_session=True) for i in range(int(opts["ntasks"]))]
    def stop(*_):
        for task in tasks:
            try:
                os.killpg(task.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, stop)
    codes = [task.wait() for task in tasks]
    sys.exit(max(abs(c) for c in codes))
    """)

SCONTROL = textwrap.dedent("""\
    #!/bin/sh
    # scontrol show hostnames's stand-in: the allocation's nodes, one per line.
    printf '127.0.0.1\\n127.0.0.1\\n127.0.0.1\\n'
    """)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install(bin_dir, name, text):
    path = bin_dir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def slurm_env(tmp_path, **settings):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    install(bin_dir, "srun", SRUN.format(python=sys.executable))
    install(bin_dir, "scontrol", SCONTROL)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="node[1-3]",
               FAKE_SLURM_LOG=str(tmp_path / "srun.log"), PYTHON=sys.executable,
               TMPDIR=str(tmp_path), ENV_LISTEN="127.0.0.1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    env.update({k: str(v) for k, v in settings.items()})
    return env


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "TLS_DIR"])
@pytest.mark.slow
def test_slurm_script_runs_servers_and_two_learner_ranks(tmp_path, tls):
    """With TLS_DIR, the job's certificates are made there and both sides use them."""
    if tls and shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    env_port = free_port()
    settings = dict(TLS_DIR=tmp_path / "tls") if tls else {}
    env = slurm_env(tmp_path, ENV_NODES=1, SERVERS_PER_NODE=2, GPUS_PER_NODE=1,
                    ENV_PORT=env_port, MASTER_PORT=free_port(), **settings)
    result = subprocess.run(
        ["bash", "scripts/slurm.sh", "--env", "CartPole-v1", "--savedir", str(tmp_path / "logs"),
         "--xpid", "run", "--no_progress", "--num_actors", "2", "--total_steps", "20000",
         "--disable_cuda"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # One step for the servers, on the first node; one for the learners, on the other two
    # (the servers' step runs in the background, so either may log first).
    steps = sorted((tmp_path / "srun.log").read_text().split(), key=len)
    assert steps == ["127.0.0.1", "127.0.0.1,127.0.0.1"]
    meta = json.loads((tmp_path / "logs" / "run" / "meta.json").read_text())
    assert meta["world_size"] == 2
    rows = runlog.read_logs(tmp_path / "logs" / "run" / "logs.csv")
    assert int(rows[-1]["step"]) >= 20000
    # 20,000 steps, over which the learning rate decays to 0, leave the policy about as good
    # as a random one (mean returns of 18-21 where a random policy's is about 22), so no
    # learning is asserted. What the run shows: one row per log interval, from rank 0 alone,
    # and games whose return equals their length, as CartPole pays 1 a step.
    flags = json.loads((tmp_path / "logs" / "run" / "flags.json").read_text())
    steps = [int(row["step"]) for row in rows]
    assert steps == sorted(set(steps)), steps
    assert len(rows) == math.ceil(flags["total_steps"] / flags["log_interval_steps"]), steps
    for row in rows:
        assert row["episodes"] > 0, row
        assert row["mean_episode_return"] == row["mean_episode_length"], row
    if tls:
        assert sorted(os.listdir(tmp_path / "tls" / "job")) == [
            "ca.key", "ca.pem", "learner.key", "learner.pem", "server.key", "server.pem"]
        # The learners dialled the servers with TLS (so the servers served it: a TLS client
        # gets nothing from a plain server).
        assert "--tls_ca" in meta["command"] and "--tls_cert" in meta["command"]
    # The job's end stopped the servers.
    left = subprocess.run(["pgrep", "-f", f"tcp:127.0.0.1:{env_port}"], capture_output=True)
    assert left.returncode == 1, left.stdout


@pytest.mark.parametrize("settings, message", [
    (dict(ENV_NODES=3), "leave none for the learner"),
    (dict(ENV_NODES=1, SERVERS_PER_NODE=1, GPUS_PER_NODE=2), "each rank needs one at least"),
])
def test_slurm_script_refuses_a_layout_that_cannot_work(tmp_path, settings, message):
    result = subprocess.run(["bash", "scripts/slurm.sh"], cwd=REPO,
                            env=slurm_env(tmp_path, **settings),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "srun.log").exists()  # nothing was started
