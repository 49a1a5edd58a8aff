"""The watchdogs over the processes that act: MonoBeast's actor processes
(beast/actor_processes.py) and PolyBeast's acting process (beast/poly/acting_process.py). One
that stops making progress anywhere in its work, or that ends before it is told to, is found
and started again, so that the learner never waits for ever on a rollout."""

import os
import re
import time

import pytest

import monobeast
import polybeast
from beast import models
from beast import restarts

TINY = ["--num_actors", "1", "--batch_size", "2", "--unroll_length", "20", "--no_progress"]
CARTPOLE = [*TINY, "--env", "CartPole-v1", "--total_steps", "400"]


def fault_once_in_an_actor(monkeypatch, tmp_path, fault, module=models, name="act"):
    """Makes the first call of module.name (by default the forward pass) that a process forked
    from the learner (an actor, PolyBeast's acting process) makes after the marker file exists
    call fault(), once in the whole run (the marker goes with it); returns the marker."""
    marker = tmp_path / "fault-marker"
    learner_pid, original = os.getpid(), getattr(module, name)

    def call_or_fault(*args, **kwargs):
        if os.getpid() != learner_pid:
            try:
                os.unlink(marker)
            except FileNotFoundError:
                pass
            else:
                fault()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, call_or_fault)
    monkeypatch.setattr(restarts, "QUICK_EXIT_S", 0.0)  # the fault comes at the first unroll
    marker.touch()
    return marker


def hang_in_the_forward_pass():
    time.sleep(3600)


def hang_in_the_start():
    time.sleep(3600)


def test_an_actor_stuck_in_its_forward_pass_prints_its_stack_and_is_started_again(
        tmp_path, monkeypatch, capfd):
    """Not only a step of the environments: a forward pass that never returns (a lock that
    the fork copied held, say) is found too."""
    marker = fault_once_in_an_actor(monkeypatch, tmp_path, hang_in_the_forward_pass)
    assert monobeast.main([*CARTPOLE, "--savedir", str(tmp_path), "--xpid", "r",
                           "--actor_timeout_s", "1"]) == 0
    err = capfd.readouterr().err
    assert not marker.exists()
    assert "Actor process 0 had spent 1 s on its start or on one step of its environments" in err
    assert "in hang_in_the_forward_pass" in err  # where it hung, from faulthandler
    assert "(restart 1)" in err and "Trained to step 400" in err + capfd.readouterr().out


@pytest.mark.timeout(120)
def test_an_actor_stuck_before_its_first_step_is_found_too(tmp_path, monkeypatch, capfd):
    """The watchdog's clock runs from the fork, not from the first step: a child that hangs
    in its start (here in the set-up before its environments exist) would otherwise leave the
    learner waiting on its first batch for ever."""
    marker = fault_once_in_an_actor(monkeypatch, tmp_path, hang_in_the_start,
                                    module=restarts, name="when_orphaned")
    assert monobeast.main([*CARTPOLE, "--savedir", str(tmp_path), "--xpid", "r",
                           "--actor_timeout_s", "1"]) == 0
    err = capfd.readouterr().err
    assert not marker.exists()
    assert "Actor process 0 had spent 1 s on its start or on one step" in err, err
    assert "in hang_in_the_start" in err
    assert "(restart 1)" in err and "Trained to step 400" in err + capfd.readouterr().out


def test_an_actor_that_exits_before_its_stop_is_started_again(tmp_path, monkeypatch, capfd):
    """A clean exit (status 0) that nobody asked for is a fault like a crash: the learner
    would wait for its rollouts for ever."""
    fault_once_in_an_actor(monkeypatch, tmp_path, lambda: os._exit(0))
    assert monobeast.main([*CARTPOLE, "--savedir", str(tmp_path), "--xpid", "r"]) == 0
    err = capfd.readouterr().err
    assert "Actor process 0 exited before it was told to stop. Starting the actors again" in err
    assert "(restart 1)" in err


def test_an_environment_error_ends_the_run_with_its_message_not_as_an_exit(tmp_path, capfd):
    """The actor that reports an environment's problem (here a NaN reward) waits for its stop,
    and the learner gives that message at once: not one about an actor that exited, and not
    after the watchdog took the waiting actor for a hung one."""
    assert monobeast.main([*TINY, "--env", "tests.flaky_env:NaNRewardCartPole-v0",
                           "--total_steps", "100000", "--savedir", str(tmp_path),
                           "--xpid", "r"]) == 2
    err = capfd.readouterr().err
    assert "as its 'reward'" in err and "exited before" not in err, err
    assert "Starting the actors again" not in err, err


@pytest.mark.parametrize("exitcode, words", [
    (0, "exited before it was told to stop"), (-9, "was killed by signal 9 (SIGKILL)"),
    (3, "died with exit code 3")])
def test_check_actors_counts_every_end_as_a_death(exitcode, words):
    class Ended:
        pass

    running, ended = Ended(), Ended()
    running.exitcode, ended.exitcode = None, exitcode
    restarts.check_actors([running])
    with pytest.raises(restarts.ActorDied, match=re.escape(words)):
        restarts.check_actors([running, ended])


# PolyBeast with one local server; its acting process is forked (a CPU learner), so the
# fault that the test puts in place reaches it.
POLY_CARTPOLE = ["--env", "CartPole-v1", "--num_actors", "1", "--batch_size", "2",
                 "--unroll_length", "20", "--total_steps", "400", "--no_progress"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where, module, name", [
    ("in its forward pass", models, "act"),
    pytest.param("before its actor pool and inference threads exist", polybeast,
                 "start_acting", marks=pytest.mark.slow)])
def test_a_hung_acting_process_prints_its_stacks_and_is_started_again(
        tmp_path, monkeypatch, capfd, where, module, name):
    """PolyBeast's acting process stuck in one inference batch (a lock that the fork copied
    held), or in its start, where the watchdog's clock runs from the fork: without the
    watchdog the learner would wait for its first, or next, batch for ever."""
    def hang_in_the_acting_process():
        time.sleep(3600)

    marker = fault_once_in_an_actor(monkeypatch, tmp_path, hang_in_the_acting_process,
                                    module=module, name=name)
    assert polybeast.main([*POLY_CARTPOLE, "--savedir", str(tmp_path), "--xpid", "r",
                           "--acting_timeout_s", "1"]) == 0, where
    err = capfd.readouterr().err
    assert not marker.exists()
    assert ("The acting process (actor threads and inference) had spent 1 s on its start or "
            "on one inference batch (--acting_timeout_s)") in err, err
    assert "in hang_in_the_acting_process" in err, err  # where it hung, from faulthandler
    assert "(restart 1)" in err and "Trained to step 400" in err + capfd.readouterr().out
