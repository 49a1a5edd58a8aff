"""What a user meets on a bad day, end to end, each run as `python -m ...` in a subprocess: an
environment that returns a NaN (or infinite) reward, an environment module that raises, and
a batched env server from before the `truncated` field. Each fault ends with one message
that names the input and what to change, and exit status 2; what was written stays.

Env servers that cannot listen: tests/test_env_server.py. Logs after a crash and a resume:
tests/test_runlog.py."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from beast import runlog

# Whole runs, each a few seconds to a minute on two cores: the slow tier.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
WAIT_S = 180


def run(tmp_path, *args, pythonpath=()):
    """python -m <args> to its end, with `pythonpath` (and the repository) importable."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, pythonpath), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=WAIT_S)


def learner(variant, tmp_path, *args):
    return [variant, "--savedir", tmp_path / "runs", "--xpid", "run", "--no_progress", *args]


def one_message(stderr):
    """The last line of stderr, which must be the run's only "error:" line."""
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == errors[0]
    return errors[0]


# ---------------------------------------------------------------------------------------------
# A reward that is not finite: refused where it enters, naming the environment and the field.

@pytest.mark.parametrize("num_actors, reward, extra",
                         [(0, "NaN", ()), (2, "NaN", ()), (2, "Infinite", ()),
                          (2, "NaN", ("--deterministic",))],
                         ids=["serial-nan", "actors-nan", "actors-inf", "deterministic-nan"])
@pytest.mark.slow
def test_monobeast_refuses_a_reward_that_is_not_finite(tmp_path, num_actors, reward, extra):
    """The model takes the reward: a NaN made NaN logits, and torch.multinomial's traceback
    ended the run. Now the actor (or, serial, the learner) that stepped the environment
    names it, its index and the field; the rows logged and the checkpoint stay."""
    env = f"tests.flaky_env:{reward}RewardCartPole-v0"  # bad after 300 steps of each env
    result = run(tmp_path, *learner(
        "monobeast", tmp_path, "--env", env, "--num_actors", num_actors,
        *(["--envs_per_actor", 4] if num_actors else []), "--batch_size", 4,
        "--unroll_length", 20, "--total_steps", 400_000,
        "--log_interval_steps", 400, *extra))
    assert result.returncode == 2, result.stderr[-3000:]
    message = one_message(result.stderr)
    value = "nan" if reward == "NaN" else "inf"
    assert f"of {env} returned {value} as its 'reward'" in message, message
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "runs" / "run"
    assert runlog.read_logs(run_dir / "logs.csv") and (run_dir / "model.tar").exists()


@pytest.mark.slow
def test_polybeast_refuses_a_nan_reward_naming_the_server(tmp_path):
    """The same from env servers: the actor pool refuses the step (libpolybeast.BadStep),
    naming the server, the field and the environment of the stream, without the hint about
    unreachable servers that a lost connection gets."""
    result = run(tmp_path, *learner(
        "polybeast", tmp_path, "--env", "tests.flaky_env:NaNRewardCartPole-v0",
        "--num_actors", 2, "--envs_per_stream", 2, "--batch_size", 4, "--unroll_length", 20,
        "--total_steps", 400_000, "--log_interval_steps", 400))
    assert result.returncode == 2, result.stderr[-3000:]
    message = one_message(result.stderr)
    assert "for env server 'raw:" in message or "for env server 'unix:" in message, message
    assert "sent a 'reward' with NaN or inf in it (environment" in message, message
    assert "start env servers there" not in message
    assert "Traceback" not in result.stderr
    # Both streams go bad at about the same step, so the other actor may fail before the
    # pool closes it: the pool logs that as "failed too", and nothing else.
    pool_lines = [line for line in result.stderr.splitlines() if "[ActorPool]" in line]
    assert all("failed too: the env server sent a 'reward'" in line for line in pool_lines), \
        pool_lines
    assert runlog.read_logs(tmp_path / "runs" / "run" / "logs.csv")


# ---------------------------------------------------------------------------------------------
# An environment module that raises: the user's traceback, then one line naming the
# environment and the module.

BROKEN_MODULES = {
    "syntax": "import gymnasium\n\ndef step(self:\n    pass\n",
    "import": "import gymnasium\n\nraise RuntimeError('the licence file is missing')\n",
    "constructor": (
        "import gymnasium\n\n\n"
        "class Broken(gymnasium.Env):\n"
        "    def __init__(self):\n"
        "        raise RuntimeError('cannot open the simulator')\n\n\n"
        "gymnasium.register('Broken-v0', entry_point=Broken)\n"),
}
RAISED = {"syntax": "importing the module 'broken_env' raised SyntaxError",
          "import": "importing the module 'broken_env' raised RuntimeError: the licence file",
          "constructor": "creating 'Broken-v0' (entry point broken_env:Broken) raised "
                         "RuntimeError: cannot open the simulator"}


@pytest.mark.parametrize("entry, fault", [
    ("monobeast", "syntax"), ("monobeast", "constructor"), ("polybeast", "import"),
    ("polybeast", "constructor"), ("polybeast_env", "syntax"), ("polybeast_env", "import")])
@pytest.mark.slow
def test_an_environment_module_that_raises_is_named_under_its_traceback(tmp_path, entry,
                                                                         fault):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "broken_env.py").write_text(BROKEN_MODULES[fault])
    env = "broken_env:Broken-v0"
    if entry == "polybeast_env":
        args = [entry, "--env", env, "--num_servers", 1, "--pipes_basename",
                f"unix:{tmp_path}/env"]
    else:
        args = learner(entry, tmp_path, "--env", env, "--total_steps", 1000)
    result = run(tmp_path, *args, pythonpath=[tmp_path / "mods"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback (most recent call last)" in result.stderr  # the user's, kept
    assert "broken_env.py" in result.stderr
    message = one_message(result.stderr)
    assert f"--env {env}: {RAISED[fault]}" in message, message
    assert "(its traceback is above)" in message
    assert not (tmp_path / "runs" / "run" / "logs.csv").exists()


# ---------------------------------------------------------------------------------------------
# Wire compatibility.

@pytest.mark.slow
def test_polybeast_trains_on_a_batched_server_from_before_truncated(tmp_path):
    """A batched server that sends no truncated and no game_over (tests/old_batched_server.py,
    gRPC from Python) serves today's learner: it used to end with "the env server sent a step
    without the env key(s) 'truncated'"."""
    address = f"unix:{tmp_path}/old"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    server = subprocess.Popen([sys.executable, "-m", "tests.old_batched_server", address, "4"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert server.stdout.readline().strip() == "serving", "the server did not start"
        result = run(tmp_path, *learner(
            "polybeast", tmp_path, "--env", "CartPole-v1", "--server_addresses", address,
            "--batch_size", 4, "--unroll_length", 20, "--total_steps", 4000,
            "--log_interval_steps", 1000))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = runlog.read_logs(tmp_path / "runs" / "run" / "logs.csv")
    assert rows[-1]["step"] >= 4000
