"""The services of a training run (beast/training.py), in-process."""

import argparse
import copy
import io
import os
import pathlib
import platform
import signal
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import torch

import flag_helpers
import monobeast
from beast import checkpoint as ckpt
from beast import evaluation, learner, models, runlog, system, training
from beast import loss as beast_loss

REPO = pathlib.Path(__file__).resolve().parent.parent


class RecordsMode(models.MLP):
    """An MLP that records whether each forward ran in train mode (sampled actions)."""

    def __init__(self):
        super().__init__((4,), 2, hidden_size=8)
        self.modes = []

    def forward(self, inputs, core_state=()):
        self.modes.append(self.training)
        return super().forward(inputs, core_state)


class RowsLogger:
    def __init__(self):
        self.rows = []

    def log(self, step, stats):
        self.rows.append((step, dict(stats)))


def test_rows_carry_the_largest_gradient_norm_since_the_previous_row():
    """A row shows the stats of one update; grad_norm_max is the largest of all the updates
    since the row before, so a spike between rows is not lost (and a skipped update's
    non-finite norm does not hide the finite ones)."""
    flags = argparse.Namespace(log_interval_steps=100, total_steps=10**6)
    logger = RowsLogger()
    stats = runlog.TrainingStats(flags, logger, start_step=0)
    norms = [5.0, 900.0, float("nan"), 7.0, 3.0, 2.0]
    for i, norm in enumerate(norms, 1):
        stats.record(50 * i, {"grad_norm": norm})
    assert [step for step, _ in logger.rows] == [100, 200, 300]
    assert [row["grad_norm"] for _, row in logger.rows] == [900.0, 7.0, 2.0]  # the last one
    assert [row["grad_norm_max"] for _, row in logger.rows] == [900.0, 7.0, 3.0]


def test_rows_say_how_long_the_learner_waited_for_batches(monkeypatch):
    """learner_wait: the share of the learner threads' time since the previous row spent
    waiting for a batch (the actors are the bottleneck when it is high, the learner when it
    is near 0). Waiting counts, learning does not; a run whose learner pulls no batches
    (serial mode) has no such column."""
    clock = [100.0]
    monkeypatch.setattr(training.time, "monotonic", lambda: clock[0])
    flags = argparse.Namespace(log_interval_steps=100, total_steps=300, num_torch_threads=1)
    logger = RowsLogger()
    stats = runlog.TrainingStats(flags, logger, start_step=0)
    stats.record(100, {})
    assert "learner_wait" not in logger.rows[-1][1]  # no learner thread yet

    def batches(waits):
        for wait in waits:
            clock[0] += wait  # the actors take this long to fill the batch
            yield wait, None

    def update(wait, _):
        clock[0] += 1.0  # a learner step
        run.step += 50
        return run.step, {}

    run = types.SimpleNamespace(flags=flags, stats=stats, step=100,
                                learner=types.SimpleNamespace(update=update))
    run.record = lambda step, step_stats, batch: stats.record(step, step_stats)
    run.done = lambda: run.step >= flags.total_steps
    monobeast.learn(run, batches([3.0, 3.0, 0.0, 1.0, 5.0]))
    assert run.step == 300  # stopped at total_steps, the last batch left untaken
    assert [step for step, _ in logger.rows] == [100, 200, 300]
    # 3 + 3 s of waiting in 8 s; then 0 + 1 in 3 s.
    assert [row["learner_wait"] for _, row in logger.rows[1:]] == [0.75, pytest.approx(1 / 3)]


# What Learner needs of the flags, for a small MLP on [4] observations.
TINY_LEARNER_FLAGS = dict(
    model="mlp", hidden_size=8, use_lstm=False, discounting=0.99, reward_clipping="none",
    reward_scale=1.0, baseline_cost=0.5, entropy_cost=0.01, grad_norm_clipping=40.0,
    precision="fp32", learning_rate=0.001, momentum=0.0, epsilon=0.01, alpha=0.99,
    lr_warmup_steps=0)


def test_policy_lag_counts_updates_between_acting_and_learning():
    """T=3, B=2, 6 steps per update, learner at step 60: the weights of step 60 acted with
    lag 0, those of step 48 with lag 2; the bootstrap step (index T) does not count."""
    policy_step = torch.tensor([[60, 48], [60, 48], [54, 60], [0, 0]])
    lag = learner.policy_lag({"policy_step": policy_step}, step=60, steps_per_update=6)
    assert lag == pytest.approx((0 + 2 + 0 + 2 + 1 + 0) / 6)


def test_the_acting_model_learns_the_step_of_its_weights():
    """Learner.update publishes the weights and then their step (Learner.weights_step, in
    shared memory for the actors); before any update the step is 0."""
    flags = flag_helpers.make_flags(unroll_length=2, batch_size=1, total_steps=100,
                                    **TINY_LEARNER_FLAGS)
    model, acting = (models.create_model(flags, (4,), 2) for _ in range(2))
    learner_ = learner.Learner(flags, model, acting)
    assert int(learner_.weights_step) == 0 and learner_.weights_step.is_shared()
    T, B = 2, 1
    batch = dict(frame=torch.zeros(T + 1, B, 4), reward=torch.zeros(T + 1, B),
                 done=torch.zeros(T + 1, B, dtype=torch.bool),
                 truncated=torch.zeros(T + 1, B, dtype=torch.bool),
                 policy_logits=torch.zeros(T + 1, B, 2), baseline=torch.zeros(T + 1, B),
                 action=torch.zeros(T + 1, B, dtype=torch.int64),
                 last_action=torch.zeros(T + 1, B, dtype=torch.int64),
                 policy_step=torch.zeros(T + 1, B, dtype=torch.int64))
    for update in range(3):
        step, stats = learner_.update(batch, model.initial_state(B))
        assert step == int(learner_.weights_step) == 2 * (update + 1)
        assert stats["policy_lag"] == update  # every batch acted with the first weights
    for name, value in model.state_dict().items():
        assert torch.equal(acting.state_dict()[name], value), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names: Linux only")
def test_run_threads_carry_their_name_as_os_thread_name():
    """So that top -H and py-spy can tell the learner from inference."""
    seen = []

    def target():
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    for name in ("inference-0", "a-name-longer-than-15-bytes"):
        thread = training.ThreadErrors().thread(name, target)
        thread.start()
        thread.join()
    assert seen == ["inference-0", "a-name-longer-t"]  # the OS keeps 15 bytes


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(),
                    reason="intra-op thread counts are per thread only with OpenMP")
def test_each_thread_keeps_the_intra_op_threads_it_set(keep_process_state):
    """PolyBeast's inference thread asks for 1 intra-op thread while the learner's keep
    more. A thread that set its count and then saw another thread set a different one
    before its first parallel op must still run with its own (a plain set_num_threads
    would take the other thread's count there)."""
    set_own, other_set = threading.Event(), threading.Event()
    seen = []

    def inference_like():
        system.set_intra_op_threads(1)
        set_own.set()
        other_set.wait()
        torch.ones(64, 64).sum()  # a first parallel op
        seen.append(torch.get_num_threads())

    def learner_like():
        set_own.wait()
        system.set_intra_op_threads(2)
        other_set.set()

    threads = [threading.Thread(target=f) for f in (inference_like, learner_like)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [1]


def test_evaluation_acts_greedily_unless_asked_to_sample():
    for policy, sampled in (("greedy", False), ("sample", True)):
        model = RecordsMode()
        flags = flag_helpers.make_flags(env="CartPole-v1", eval_policy=policy)
        returns = evaluation.play_episodes(flags, model, num_episodes=2, seed=0)
        assert len(returns) == 2 and set(model.modes) == {sampled}


def test_evaluation_refuses_a_reward_that_is_not_finite():
    """An evaluation's environment is checked as the actors' are: a NaN reward would make
    the logged eval_mean_episode_return NaN. It names the environment and the field."""
    env = "tests.flaky_env:NaNRewardCartPole-v0"  # NaN rewards after 300 steps
    flags = flag_helpers.make_flags(env=env, eval_policy="greedy")
    with pytest.raises(evaluation.BadStep, match=f"of {env} returned nan as its 'reward'"):
        evaluation.play_episodes(flags, RecordsMode(), num_episodes=1000, seed=0)


def test_greedy_evaluation_is_deterministic():
    """Same weights, same seed: the same returns, since no action is sampled."""
    model = RecordsMode()
    flags = flag_helpers.make_flags(env="CartPole-v1", eval_policy="greedy")
    torch.manual_seed(1)
    first = evaluation.play_episodes(flags, model, num_episodes=3, seed=5)
    torch.manual_seed(2)
    assert evaluation.play_episodes(flags, model, num_episodes=3, seed=5) == first


def test_a_game_longer_than_eval_max_steps_is_stopped_and_counts_its_return_so_far(capsys):
    """CartPole pays 1 a step and no game ends within 3 steps (the pole starts near upright):
    each game is stopped at the third step with 3.0, and the next starts afresh."""
    flags = flag_helpers.make_flags(env="CartPole-v1", eval_policy="greedy", eval_max_steps=3)
    assert evaluation.play_episodes(flags, RecordsMode(), num_episodes=3, seed=0) == [3.0] * 3
    assert capsys.readouterr().err.count("stopped at --eval_max_steps 3,") == 3
    flags.eval_max_steps = 0  # no limit: whole games
    assert min(evaluation.play_episodes(flags, RecordsMode(), num_episodes=3, seed=0)) > 3


def test_a_test_shows_its_games_so_far_on_the_status_line():
    """--mode test's status line counts the finished games, the steps played and the mean
    return of the finished games, so that a test of many long games shows it is playing."""
    stream, now = io.StringIO(), iter(range(10**6))  # a second a call: a line each step
    progress = evaluation.GameProgress(4, "greedy", stream=stream, interval=0.5,
                                       clock=lambda: float(next(now)))
    flags = flag_helpers.make_flags(env="CartPole-v1", eval_policy="greedy", eval_envs=2)
    returns = evaluation.play_episodes(flags, RecordsMode(), num_episodes=4, seed=0,
                                       progress=progress)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("test, greedy | games 0/4 | steps 2 | SPS ")
    assert "mean return" not in lines[0]
    steps = sum(returns)  # CartPole pays 1 a step
    last = f"test, greedy | games 4/4 | steps {steps:,.0f} | SPS "
    assert lines[-1].startswith(last) and f"mean return so far {np.mean(returns):.2f}" in lines[-1]
    counts = [int(line.split("games ")[1].split("/")[0]) for line in lines]
    assert counts == sorted(counts) and len(set(counts)) == 5


def value_of(model, observation):
    """The model's baseline on one observation (one step, one environment)."""
    inputs = dict(frame=torch.tensor([[[observation]]], dtype=torch.float32),
                  reward=torch.ones(1, 1), done=torch.zeros(1, 1, dtype=torch.bool),
                  last_action=torch.zeros(1, 1, dtype=torch.int64))
    with torch.no_grad():
        outputs, _ = model(inputs, model.initial_state(1))
    return float(outputs["baseline"])


@pytest.mark.parametrize("variant, envs_per_stream", [
    ("monobeast", None), ("polybeast", "4"), ("polybeast", "1")],
    ids=["monobeast", "polybeast-batched", "polybeast-single"])
@pytest.mark.slow
def test_time_limits_bootstrap(tmp_path, variant, envs_per_stream):
    """Reward 1 forever, episodes cut at 20 steps: with discount 0.9 the value of every step
    is the infinite sum 1 / (1 - 0.9) = 10. Treating the cut as the episode's end would
    make the value of the last step 1 (and of step t, 10 * (1 - 0.9^(20 - t)))."""
    command = [sys.executable, "-m", variant, "--env", "tests.time_limit_env:ConstantReward-v0",
               "--savedir", str(tmp_path), "--xpid", "limit", "--no_progress",
               "--discounting", "0.9", "--total_steps", "10000", "--hidden_size", "32",
               "--unroll_length", "20", "--batch_size", "8", "--entropy_cost", "0",
               # High enough, and from the first update on (the vector tasks' warm-up would
               # hold it low for the whole run), that the values reach 10 in the run.
               "--learning_rate", "0.01", "--lr_warmup_steps", "0",
               "--reward_scale", "1.0"]  # the values below are in the reward's own units
    if variant == "polybeast":
        # One environment per stream: truncated travels in its own Step field; more: in
        # the batch's dict.
        command += ["--num_actors", "2", "--envs_per_stream", envs_per_stream]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    state = ckpt.load_checkpoint(tmp_path / "limit" / "model.tar")
    model = models.MLP((1,), 2, hidden_size=32)
    model.load_state_dict(state["model_state_dict"])
    near_the_limit = value_of(model, 19 / 20)
    assert near_the_limit > 8, f"V(step 19) = {near_the_limit:.2f}; bootstrapped it is ~10"
    assert abs(value_of(model, 5 / 20) - 10) < 2


def test_a_stop_signal_delivered_twice_at_once_is_one_request(monkeypatch):
    """GNU timeout signals its child, then the child's process group: two SIGTERMs at once
    must stop the run cleanly (with its checkpoint), not as a second Ctrl-C would."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = system.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set()
        monkeypatch.setattr(system, "REPEATED_SIGNAL_S", 0.0)  # as if seconds had passed
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# A learner step's pattern: a thread allocates and frees large blocks (activations and
# gradients) every step. Prints the page faults of each of 12 steps.
_FAULTS_SCRIPT = """
import resource, sys, threading, torch
from beast import system
if sys.argv[1] == "reuse":
    system.reuse_freed_memory()
faults = []
def steps():
    for i in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(12 << 20) for _ in range(4)]  # 4 x 48 MB, written
        del blocks
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(*faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.slow
def test_freed_memory_is_reused_not_faulted_in_again():
    """Without reuse_freed_memory every step faults its 192 MB in anew (about 49,000 pages of
    4 KiB, fewer where transparent huge pages back them); with it, once the heap has
    settled, a step reuses the memory the last freed. How many steps the heap takes to
    settle varies from run to run (usually two or three, now and then a block later), so
    the test counts the steps of the second half that fault in almost nothing."""
    faults = {}
    for mode in ("default", "reuse"):
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
        faults[mode] = [int(word) for word in out.split()][6:]
    step = sorted(faults["default"])[len(faults["default"]) // 2]  # what one step faults in
    quiet = {mode: sum(f * 20 < step for f in faults[mode]) for mode in faults}
    assert quiet["default"] == 0 and quiet["reuse"] >= 4, faults


@pytest.mark.parametrize("variant", ["monobeast", "polybeast"])
@pytest.mark.slow
def test_a_refused_run_writes_nothing(tmp_path, variant):
    """A model that cannot take the environment's observations is refused before the run
    directory exists: no flags.json, lock or empty tensorboard/ that --mode test or a
    resume would take for a run."""
    command = [sys.executable, "-m", variant, "--env", "CartPole-v1", "--model", "atari",
               "--savedir", str(tmp_path / "runs"), "--xpid", "refused"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--model atari needs image observations" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "refused").exists()


def test_games_are_shared_out_before_any_starts():
    assert evaluation.game_shares(10, 8) == [2, 2, 1, 1, 1, 1, 1, 1]
    assert evaluation.game_shares(3, 8) == [1, 1, 1]
    assert evaluation.game_shares(100, 1) == [100]
    assert sum(evaluation.game_shares(101, 8)) == 101


@pytest.mark.parametrize("use_lstm", [False, True])
def test_games_played_together_are_the_games_each_environment_plays_alone(use_lstm):
    """Several environments in one forward pass play, game for game, what each plays alone
    with its own seed (the one-environment path is the reference): the core state and the
    actions of each environment stay its own. Greedy, so no sampling differs."""
    torch.manual_seed(0)
    model = models.MLP((4,), 2, hidden_size=8, use_lstm=use_lstm)
    flags = flag_helpers.make_flags(env="CartPole-v1", eval_policy="greedy", eval_envs=3)
    together = evaluation.play_episodes(flags, model, num_episodes=7, seed=11)
    flags.eval_envs = 1
    alone = []
    for index, share in enumerate(evaluation.game_shares(7, 3)):
        alone += evaluation.play_episodes(flags, model, share, evaluation.env_seed(11, index))
    assert len(together) == 7 and together == alone
    assert len(set(together)) > 1  # the environments' games differ: the test can tell


def tiny_batch(T, B, seed=0):
    """A rollout of random frames, rewards and actions for the tiny MLP of 2 actions."""
    generator = torch.Generator().manual_seed(seed)
    return dict(frame=torch.randn(T + 1, B, 4, generator=generator),
                reward=torch.randn(T + 1, B, generator=generator),
                done=torch.zeros(T + 1, B, dtype=torch.bool),
                truncated=torch.zeros(T + 1, B, dtype=torch.bool),
                policy_logits=torch.randn(T + 1, B, 2, generator=generator),
                baseline=torch.zeros(T + 1, B),
                action=torch.randint(2, (T + 1, B), generator=generator),
                last_action=torch.zeros(T + 1, B, dtype=torch.int64),
                policy_step=torch.zeros(T + 1, B, dtype=torch.int64))


@pytest.mark.parametrize("pg_clip", [0.0, 0.1])
def test_epochs_make_that_many_updates_at_the_batchs_learning_rate(pg_clip):
    """--epochs 3: one Learner.update is three learn_steps on the same batch, all at the rate
    of the batch's place in the schedule, which then moves once; the step counter counts the
    batch once. With the trust region the later passes find the policy moved off the one that
    acted, so the region binds."""
    T, B = 4, 3
    flags = flag_helpers.make_flags(unroll_length=T, batch_size=B, total_steps=120, epochs=3,
                                    pg_clip=pg_clip, **TINY_LEARNER_FLAGS)
    flags.learning_rate = 0.05
    model, acting = (models.create_model(flags, (4,), 2) for _ in range(2))
    reference = copy.deepcopy(model)
    learner_ = learner.Learner(flags, model, acting)
    batch = tiny_batch(T, B)
    step, stats = learner_.update(batch, model.initial_state(B))
    assert step == T * B
    # By hand: three RMSprop steps at the first update's rate (1 - 0/120), from the same state.
    optimizer = torch.optim.RMSprop(reference.parameters(), lr=flags.learning_rate,
                                    alpha=flags.alpha, eps=flags.epsilon)
    for _ in range(3):
        outputs, _ = reference(batch, ())
        loss, last = beast_loss.compute_loss(flags, outputs, batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), flags.grad_norm_clipping)
        optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert stats["total_loss"] == pytest.approx(float(last["total_loss"]), rel=1e-5)
    assert learner_.scheduler.get_last_lr()[0] == pytest.approx(0.05 * (1 - 12 / 120))
    if pg_clip:
        assert stats["pg_clipped"] > 0
