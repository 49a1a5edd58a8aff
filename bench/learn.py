"""python -m bench.learn: does it learn? Final returns and learning curves over seeds.

Runs the suite (SUITE: CartPole-v1, Acrobot-v1, the five MinAtar games, HalfCheetah-v5) for
each variant and seed with the launcher (bench/launch.py: resumable, a few runs at once,
failures recorded), plays --test_episodes episodes with each finished run's final
checkpoint (sampled and greedy), then reads every run's logs.csv and tests.jsonl and writes a
markdown report: per environment, one table row per variant, one PNG with a curve per variant.

    python -m bench.learn            # the whole suite (long: 150M MinAtar steps in all)
    python -m bench.learn --envs CartPole-v1 --seeds 0,1 --variants monobeast
    python -m bench.learn --envs MinAtar/Breakout-v1 --total_steps 1000000 --output learn.md
    python -m bench.learn --no_launch --output learn.md     # report on the runs already there
    python -m bench.learn ... -- --num_actors 4             # flags for every run after `--`

Stopping it (Ctrl-C) stops the runs, which checkpoint; the same command again skips the runs
that reached total_steps and resumes the others.

What the numbers mean is HOW_TO_READ below, which heads the report. The published references
(each SUITE entry's `reference`) hold only what we could check, and say where the comparison
is not like for like.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python -m bench.learn` from another directory
    sys.path.insert(0, REPO)

from beast import flags as beast_flags  # noqa: E402
from beast import runlog  # noqa: E402

from bench import launch  # noqa: E402

# ---------------------------------------------------------------------------------------------
# The suite and what was published about it.


@dataclasses.dataclass(frozen=True)
class Reference:
    """A published result to set beside ours. value is text ("" where not filled in)."""
    value: str
    source: str
    note: str  # where the comparison is not like for like


@dataclasses.dataclass(frozen=True)
class SuiteEnv:
    # None: the repo's default for this kind of environment (beast.flags.ENV_DEFAULTS), which
    # the run's flags.json records.
    total_steps: int = None
    args: tuple = ()  # extra flags for this env's runs; --env_args adds to them
    reference: Reference = None


MINATAR_STEPS = 5_000_000  # the MinAtar paper's training length (5M frames = 5M steps)

MINATAR_PAPER = "Young & Tian 2019, MinAtar (arXiv 1903.03176)"
MINATAR_NOTE = (
    "Not like for like. Their agents are DQN (replay buffer, target network, epsilon-greedy) "
    "and online actor-critic with eligibility traces, AC(lambda), not IMPALA; each curve is "
    "the average of 30 runs (the MinAtar README), against our few seeds. The repository's "
    "examples/dqn.py trains for 5,000,000 frames (one frame is one step; MinAtar has no frame "
    "skip) on MinAtar's full 6-action set, while the MinAtar/*-v1 ids we train on use each "
    "game's minimal action set. Both use MinAtar's Environment defaults, sticky actions with "
    "probability 0.1 and difficulty ramping, which the v1 ids keep.")
# The value is left blank on purpose: the paper and the README show the baselines' returns
# as learning curves, and we could not check an exact final number for any game here. A
# number read off a plot would be invented precision; fill one in only with the paper's
# table or text cited (page, table), never from memory.
MINATAR_REFERENCE = Reference("", MINATAR_PAPER, MINATAR_NOTE)

# No published IMPALA numbers exist for these; the report adds Gymnasium's "solved" threshold
# (the env spec's reward_threshold), which is a definition, not a result.
CLASSIC_REFERENCE = Reference("", "No published IMPALA result for this env",
                              "Both ids cut episodes at 500 steps, so CartPole-v1 returns "
                              "lie in [0, 500] and Acrobot-v1 returns in [-500, 0].")

MUJOCO_STEPS = 1_000_000  # the step count most MuJoCo results are reported at
# A2C is the nearest published relative of IMPALA here (on-policy actor-critic, one gradient
# step per batch, no trust region); PPO is the usual bar.
HALFCHEETAH_REFERENCE = Reference(
    "A2C 1,830 ± 1,068; PPO 5,784 ± 1,244 (Tianshou, 1M steps)",
    "Tianshou's MuJoCo benchmark (github.com/thu-ml/tianshou, examples/mujoco/README.md), "
    "A2C and PPO tables at 1M steps; the same tables give OpenAI Baselines' PPO ~1,700 and "
    "the PPO paper's (arXiv 1707.06347) A2C ~1,000, both read off plots",
    "Not like for like. Their number is the best, over training, of the average return of "
    "a separate deterministic test policy (10 test episodes), averaged over 10 seeds, on "
    "HalfCheetah-v3 with observation normalization; ours is the mean of the last 100 "
    "training episodes (stochastic policy) at the end, over our seeds, on HalfCheetah-v5 "
    "without normalization.")

SUITE = {
    "CartPole-v1": SuiteEnv(reference=CLASSIC_REFERENCE),
    # Needs the vector default's rewards x 0.1: unscaled (returns near -100 to -500), 2 of 3
    # MonoBeast seeds stayed at -500 for 1.5M steps (bench/results/LEARN-acrobot-unscaled.md).
    "Acrobot-v1": SuiteEnv(reference=CLASSIC_REFERENCE),
    **{f"MinAtar/{game}-v1": SuiteEnv(MINATAR_STEPS, reference=MINATAR_REFERENCE)
       for game in ("Breakout", "Asterix", "Freeway", "Seaquest", "SpaceInvaders")},
    # Needs pip install "gymnasium[mujoco]". Locomotion pays over a long horizon: the
    # continuous defaults' discount 0.9 (tuned on Pendulum) looks 10 steps ahead.
    "HalfCheetah-v5": SuiteEnv(MUJOCO_STEPS, args=("--discounting", "0.99"),
                               reference=HALFCHEETAH_REFERENCE),
}


def solved_threshold(env):
    """Gymnasium's reward_threshold for env, or None (unknown id, none registered)."""
    try:
        import gymnasium

        return gymnasium.spec(env).reward_threshold
    except Exception:  # any registry error only means there is nothing to show
        return None


# ---------------------------------------------------------------------------------------------
# One run's logs.

@dataclasses.dataclass
class Curve:
    """What one run's logs.csv says. steps/returns: the rows with a mean_episode_return,
    steps strictly increasing (see drop_superseded)."""
    steps: list
    returns: list
    last_step: float = math.nan  # the largest step logged
    wall_s: float = math.nan
    eval_return: float = math.nan  # the eval_mean_episode_return of the latest snapshot
    # Offline evaluations (--eval_interval_steps) by the step of their snapshot, in step order.
    eval_steps: list = dataclasses.field(default_factory=list)
    eval_returns: list = dataclasses.field(default_factory=list)
    # The softmax policy's mean entropy per step (nats) in each row's batch, in step order.
    entropy_steps: list = dataclasses.field(default_factory=list)
    entropies: list = dataclasses.field(default_factory=list)
    # [from, to) steps after each resume where the 100-episode mean is not yet the run's
    # (see resume_settling); falls() passes over them.
    settling: list = dataclasses.field(default_factory=list)
    # By --eval_policy (TEST_POLICIES): the returns of the latest `--mode test` of the run's
    # last checkpoint (tests.jsonl), and that checkpoint's step; a policy without one is absent.
    test_returns: dict = dataclasses.field(default_factory=dict)
    test_steps: dict = dataclasses.field(default_factory=dict)
    # With --pg_clip: each row's share of the batch that the trust region cut (pg_clipped).
    pg_clipped: list = dataclasses.field(default_factory=list)

    def test_return(self, policy):
        """The mean return of the latest test of the final checkpoint with policy, or nan."""
        returns = self.test_returns.get(policy)
        return statistics.fmean(returns) if returns else math.nan

    def first_at(self, threshold, evaluation=False):
        """The first step where the training curve (or, with evaluation, an offline
        evaluation of that step's weights) reached threshold; None if none did."""
        steps, values = ((self.eval_steps, self.eval_returns) if evaluation
                         else (self.steps, self.returns))
        return next((s for s, v in zip(steps, values) if v >= threshold), None)

    @property
    def final_return(self):
        return self.returns[-1] if self.returns else math.nan

    def falls(self):
        """Every fall of the curve: (step, peak, low) of each time the 100-episode mean loses
        half of what it had gained over its start, the curve's first value: it drops below
        start + (peak - start) / 2, where peak is the best it had reached. Measured from the
        start rather than from zero, it reads negative returns (Pong starts near -21) as it
        reads positive ones, and a dip before the curve has gone far counts as one (MinAtar
        Breakout's early policies can lose most of a small gain and learn on).

        A fall counts only once peak - start is at least FALL_MIN_GAIN of the run's largest
        gain (its highest value - start): below that, the curve has barely moved, and its
        noise is no fall. After a fall, the next one counts only once the curve is back at
        FALL_REARM of the peak's gain. A curve whose largest gain is below FALL_MIN_MOVE of its
        start's size has not moved, and has none: a policy that has not started, wobbling at
        Pong's -20.5, would otherwise fall at every wobble. The
        rows of a resume's settling are passed over, the start among them: a fall that lasts
        beyond them is still found in the rows after.
        """
        points = [(step, value) for step, value in zip(self.steps, self.returns)
                  if not any(begin <= step < end for begin, end in self.settling)]
        if not points:
            return []
        start = points[0][1]
        largest_gain = max(value for _, value in points) - start
        if not largest_gain > FALL_MIN_MOVE * abs(start):
            return []  # it has not moved: Pong's wobble at -20.5 is no fall
        found, peak, armed = [], start, True
        for step, value in points[1:]:
            gain = peak - start
            if armed and gain >= FALL_MIN_GAIN * largest_gain and value < start + gain / 2:
                found.append((step, peak, value))
                armed = False
            peak = max(peak, value)
            armed = armed or value - start >= FALL_REARM * (peak - start)
        return found

    def collapse(self):
        """The first fall (see falls), or None."""
        falls = self.falls()
        return falls[0] if falls else None

    def deterministic(self):
        """Each time the policy turned deterministic: (step, return) of each row whose batch's
        mean entropy is below DETERMINISTIC_NATS, counted again only after the entropy is back
        above REARM_NATS; the return is the training curve's at that step. Such a policy plays
        one action in every state, and the entropy bonus, whose gradient vanishes there, is
        all that brings it back. A fall of the curve can miss it: a collapse before the curve
        has gained FALL_MIN_GAIN of its largest gain over its start is no fall.
        """
        found, armed = [], True
        for step, entropy in zip(self.entropy_steps, self.entropies):
            if armed and entropy < DETERMINISTIC_NATS:
                at = [r for s, r in zip(self.steps, self.returns) if s <= step]
                found.append((step, at[-1] if at else math.nan))
                armed = False
            armed = armed or entropy > REARM_NATS
        return found


# A fall needs a peak gain over the start of at least this share of the run's largest gain, and
# the next fall a recovery to FALL_REARM of the peak's gain: Curve.falls.
FALL_MIN_GAIN = 0.1
FALL_REARM = 0.9
# A curve whose largest gain over its start is below this share of the start's size has not
# moved, and has no falls.
FALL_MIN_MOVE = 0.1

# Below 0.01 nats a step, a policy plays one action with probability above 0.999 in nearly
# every state. The collapsed SpaceInvaders runs fell to 1e-3-1e-15 and their return to 0;
# MinAtar runs without a collapse stayed above 0.02. It is not always a collapse: CartPole's
# best policy is deterministic, and 3 of 35 CartPole runs (MonoBeast, 256 environments) had
# one such row, one of them in a fall of the return.
DETERMINISTIC_NATS = 0.01
REARM_NATS = 0.05


def drop_superseded(rows):
    """The rows of logs.csv in time order, without those a resume made stale.

    A resumed run goes back to its checkpoint's step and appends; the earlier start's rows
    past that step describe training that was thrown away, and the first training row with a
    smaller step shows where. Evaluation rows cannot show it: each is written when its
    evaluation ends, at the step of its snapshot, which training may have passed long before
    (the whole run, on CartPole). Rows at the same step both stay.
    """
    kept, last_training_step = [], -math.inf
    for row in rows:
        if not finite_value(row, "eval_mean_episode_return"):
            if row["step"] < last_training_step:
                kept = [r for r in kept if r["step"] <= row["step"]]
            last_training_step = row["step"]
        kept.append(row)
    return kept


def wall_time(times, starts=()):
    """Seconds a run spent: for each start, from the start to its last row, summed (the
    last of runlog.training_seconds); nan without rows."""
    times = sorted(t for t in times if math.isfinite(t))
    return runlog.training_seconds(times, starts)[-1] if times else math.nan


def resume_settling(rows, starts, num_envs):
    """[from, to) steps after each resume during which the 100-episode mean is biased low.

    A resume restores the window of the last 100 episodes but starts every environment
    afresh, and the first of the new episodes to end are the shortest: the mean dips for a
    while (by a third to a half on SpaceInvaders, back after 150-200 episodes with 128
    environments) though nothing was unlearnt. It settles once each environment has ended an
    episode and a window more has ended: num_envs + 100 episodes after the resume, by the
    `episodes` column. Without that column (hand-made logs) nothing is settling.
    """
    windows = []
    # Training rows only: an evaluation row carries the step of its snapshot, not the time's.
    rows = [r for r in rows if not finite_value(r, "eval_mean_episode_return")]
    for start in starts[1:]:
        before = [r for r in rows if r["_time"] < start and finite_value(r, "episodes")]
        after = [r for r in rows if r["_time"] >= start and finite_value(r, "step")]
        if not before or not after:
            continue
        settled = before[-1]["episodes"] + num_envs + EPISODE_WINDOW
        end = next((r["step"] for r in after if r.get("episodes", -math.inf) >= settled),
                   math.inf)
        windows.append((after[0]["step"], end))
    return windows


EPISODE_WINDOW = 100  # the episodes mean_episode_return averages over (runlog.EpisodeStats)


def run_num_envs(path):
    """How many environments the latest start of the run in path stepped (flags.json), 0 when
    it does not say."""
    try:
        with open(os.path.join(path, "flags.json")) as f:
            flags = json.load(f)
        per_actor = flags.get("envs_per_stream") or flags.get("envs_per_actor") or 1
        return int(flags["num_actors"]) * int(per_actor)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def finite_value(row, key):
    """Whether row[key] is a finite float (a CSV cell that was empty reads as NaN or is absent)."""
    value = row.get(key, math.nan)
    return isinstance(value, float) and math.isfinite(value)


def read_curve(path):
    """The Curve of the run directory at path; None when it has no logs.csv."""
    logs_path = os.path.join(path, "logs.csv")
    if not os.path.isfile(logs_path):
        return None
    raw = [r for r in runlog.read_logs(logs_path) if finite_value(r, "step")]
    rows = drop_superseded(raw)
    points = {}
    for row in rows:
        if finite_value(row, "mean_episode_return"):  # nan until the first episode ends
            points[row["step"]] = row["mean_episode_return"]  # the later of equal steps
    # By step: an evaluation row is written when the evaluation ends, maybe after later ones.
    evals = sorted({r["step"]: r["eval_mean_episode_return"] for r in rows
                    if finite_value(r, "eval_mean_episode_return")}.items())
    entropies = policy_entropies(rows, path)
    timed = [r for r in rows if finite_value(r, "_time")]
    tests = {policy: latest_test(path, policy) for policy in TEST_POLICIES}
    tests = {policy: test for policy, test in tests.items() if test}
    return Curve(steps=list(points), returns=list(points.values()),
                 entropy_steps=[s for s, _ in entropies], entropies=[e for _, e in entropies],
                 settling=resume_settling(timed, runlog.start_times(path), run_num_envs(path)),
                 test_returns={policy: test["returns"] for policy, test in tests.items()},
                 test_steps={policy: test["step"] for policy, test in tests.items()},
                 eval_steps=[s for s, _ in evals], eval_returns=[v for _, v in evals],
                 pg_clipped=[r["pg_clipped"] for r in rows if finite_value(r, "pg_clipped")],
                 last_step=max((r["step"] for r in rows), default=math.nan),
                 wall_s=wall_time([r["_time"] for r in raw if finite_value(r, "_time")],
                                  runlog.start_times(path)),
                 eval_return=evals[-1][1] if evals else math.nan)


# The --eval_policy values each finished run's final checkpoint is tested with, and the report
# column of each. Sampled actions are what the training return measures, from the final
# weights alone; greedy ones (the argmax) show the policy without its exploration.
TEST_POLICIES = {"sample": "checkpoint, sampled (mean ± std over seeds)",
                 "greedy": "checkpoint, greedy"}


def run_tests(path, policy):
    """The records (runlog.record_test) of the run's tests with policy, from its tests.jsonl,
    in the order written."""
    return [t for t in runlog.read_tests(os.path.join(path, "tests.jsonl"))
            if t.get("policy") == policy and isinstance(t.get("step"), (int, float))]


def latest_test(path, policy):
    """The record of the last test with policy of the run's furthest checkpoint; None
    without one."""
    tests = run_tests(path, policy)
    furthest = max((t["step"] for t in tests), default=None)
    return [t for t in tests if t["step"] == furthest][-1] if tests else None


def test_command(spec, savedir, episodes, policy):
    """The argv that plays `episodes` episodes with the run's checkpoint, acting by policy (one
    process, whatever launched the training: a test does not run under torchrun)."""
    module, _ = launch.LAUNCHERS[spec.variant]
    return [sys.executable, "-m", module, "--mode", "test", "--savedir", savedir, "--xpid",
            spec.xpid, "--test_episodes", str(episodes), "--eval_policy", policy]


def needs_test(result, savedir, episodes, policy):
    """Whether a finished run lacks a test with policy of at least `episodes` episodes with a
    checkpoint of its total_steps."""
    if episodes <= 0 or not finished(result):
        return False
    return not any(t["step"] >= result.target and len(t["returns"]) >= episodes
                   for t in run_tests(launch.run_dir(result.spec, savedir), policy))


def test_runs(results, savedir, episodes):
    """Plays --test_episodes episodes with each finished run's final checkpoint, once per
    policy of TEST_POLICIES, one test at a time, unless tests.jsonl already has such a test; a
    failed test is reported and leaves the report's cell without that seed."""
    todo = [(r, policy) for r in results for policy in TEST_POLICIES
            if needs_test(r, savedir, episodes, policy)]
    for index, (result, policy) in enumerate(todo, 1):
        xpid = result.spec.xpid
        launch.progress(f"test {index}/{len(todo)} {xpid}: {episodes} episodes, {policy}")
        done = subprocess.run(test_command(result.spec, savedir, episodes, policy),
                              cwd=launch.REPO, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-launch.STDERR_TAIL_LINES:])
            launch.progress(f"test ({policy}) of {xpid} failed ({done.returncode}):\n{tail}")


def policy_entropies(rows, path):
    """(step, mean entropy per step) of each training row, in step order.

    From the policy_entropy column, which every run with a softmax policy writes (a Gaussian
    policy writes none). Runs begun before the column existed (a start of theirs has a
    flags.json without --pg_clip, which came with it) lack it in their early rows; for those
    rows the entropy is read back from entropy_loss (-entropy_cost x the entropy summed over
    T x B). Every such run with an entropy cost had a softmax policy (the continuous defaults
    have none), so a Gaussian's entropy term is never misread as a softmax's.
    """
    per_step = math.nan
    try:
        for name in os.listdir(path):
            if re.fullmatch(r"flags\.json(\.\d+)?", name):
                with open(os.path.join(path, name)) as f:
                    flags = json.load(f)
                if "pg_clip" not in flags:  # a start from before policy_entropy existed
                    per_step = flags["entropy_cost"] * flags["unroll_length"] * flags["batch_size"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = []
    for row in rows:
        if finite_value(row, "policy_entropy"):
            found.append((row["step"], row["policy_entropy"]))
        elif finite_value(row, "entropy_loss") and per_step > 0:
            found.append((row["step"], -row["entropy_loss"] / per_step))
    return found


# ---------------------------------------------------------------------------------------------
# Over seeds.

@dataclasses.dataclass
class Spread:
    n: int  # finite values
    mean: float = math.nan
    std: float = math.nan  # sample std (n-1); nan below 2 values
    lo: float = math.nan
    hi: float = math.nan


def spread(values):
    """Mean, sample std, min and max of the finite values (a seed without one is left out)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return Spread(0)
    std = statistics.stdev(values) if len(values) > 1 else math.nan
    return Spread(len(values), statistics.fmean(values), std, min(values), max(values))


def common_grid(curves, points=200):
    """`points` steps, evenly spaced over the range every curve covers (first to last point).

    Empty when no curve has a point or the ranges do not overlap; one step when they meet
    at a single step. Interpolating inside the common range only means the mean line never
    changes which seeds it averages.
    """
    curves = [c for c in curves if c is not None and c.steps]
    if not curves:
        return np.empty(0)
    lo = max(c.steps[0] for c in curves)
    hi = min(c.steps[-1] for c in curves)
    if lo > hi:
        return np.empty(0)
    return np.array([lo]) if lo == hi else np.linspace(lo, hi, points)


def interpolate(curves, grid):
    """float64 [len(curves), len(grid)]: each curve's returns, linear between its points."""
    return np.array([np.interp(grid, c.steps, c.returns) for c in curves]).reshape(
        len(curves), len(grid))


def band(curves, points=200):
    """(grid, mean, lo, hi) over the curves that have points: the mean line and the min-max
    band on common_grid. Each is float64 [len(grid)]; all empty without a common range."""
    curves = [c for c in curves if c is not None and c.steps]
    grid = common_grid(curves, points)
    if not len(grid):
        return grid, grid, grid, grid
    values = interpolate(curves, grid)
    return grid, values.mean(axis=0), values.min(axis=0), values.max(axis=0)


# ---------------------------------------------------------------------------------------------
# The report.

def fmt(x, digits=1):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def fmt_spread(s, digits=1):
    if s.n == 0:
        return "n/a"
    return fmt(s.mean, digits) + ("" if s.n < 2 else f" ± {fmt(s.std, digits)}")


def fmt_range(s, digits=1):
    if s.n == 0:
        return "n/a"
    return fmt(s.lo, digits) if s.lo == s.hi else f"{fmt(s.lo, digits)} – {fmt(s.hi, digits)}"


def fmt_duration(seconds):
    if not math.isfinite(seconds):
        return "n/a"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def finished(result):
    return result.target is not None and result.steps >= result.target


RETURN_DIGITS = 2  # MinAtar Breakout's early returns differ in the second decimal
# The checkpoint's tests sit beside the final return: the same policy's score at the end of
# training, from the training curve and from the final weights.
TABLE_HEADER = ["variant", "final return (mean ± std)", *TEST_POLICIES.values(), "min – max",
                "seeds finished", "failures", "collapses", "falls", "turned deterministic",
                "steps to solved (median)", "steps reached",
                "wall time per run", "SPS", "eval return",
                "trust region cut (median)", "published reference"]


def fmt_steps_to(curves, threshold):
    """The median step at which the seeds' training curves, and their evaluations where the
    runs evaluated, first reached threshold, with how many seeds did; "—" without one."""
    if threshold is None:
        return "—"
    parts = []
    for name, evaluation in (("training", False), ("evaluation", True)):
        seeds = [c for c in curves if c is not None and (c.eval_steps if evaluation else True)]
        if not seeds:
            continue
        reached = [s for s in (c.first_at(threshold, evaluation) for c in seeds) if s is not None]
        median = f"{statistics.median(reached) / 1e6:.2f}M " if reached else ""
        parts.append(f"{name} {median}({len(reached)}/{len(seeds)})")
    return ", ".join(parts) or "—"


def table_row(variant, results, curves, reference, threshold=None):
    """One variant's cells: results and curves are per seed, in the same order; threshold:
    the return that counts as solved, if the env has one."""
    finals = spread([c.final_return if c else math.nan for c in curves])
    final_text = fmt_spread(finals, RETURN_DIGITS)
    if 0 < finals.n < len(results):  # some seed has not finished an episode
        final_text += f" ({finals.n} seeds)"
    steps = spread([c.last_step if c else math.nan for c in curves])
    targets = sorted({r.target for r in results if r.target is not None})
    steps_text = fmt_range(steps, 0) + (f" of {', '.join(f'{t:,}' for t in targets)}"
                                        if targets else "")
    return [variant, final_text, *(fmt_test(curves, policy) for policy in TEST_POLICIES),
            fmt_range(finals, RETURN_DIGITS),
            f"{sum(map(finished, results))}/{len(results)}",
            str(sum(r.status == "failed" for r in results)), fmt_collapses(curves),
            fmt_falls(curves), fmt_deterministic(curves), fmt_steps_to(curves, threshold),
            steps_text,
            fmt_duration(spread([c.wall_s if c else math.nan for c in curves]).mean),
            fmt_sps(spread([c.last_step / c.wall_s if c and c.wall_s > 0 else math.nan
                            for c in curves]).mean),
            fmt_spread(spread([c.eval_return if c else math.nan for c in curves]), RETURN_DIGITS),
            fmt_pg_clipped(curves),
            (reference.value or "— (see below)") if reference else "—"]


def fmt_test(curves, policy):
    """Mean ± std over seeds of each seed's test return with policy, and the seeds and
    episodes a seed; n/a when no seed has such a test."""
    tested = [c for c in curves if c is not None and c.test_returns.get(policy)]
    if not tested:
        return "n/a"
    counts = sorted({len(c.test_returns[policy]) for c in tested})
    episodes = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (fmt_spread(spread([c.test_return(policy) for c in tested]), RETURN_DIGITS)
            + f" ({len(tested)} seeds x {episodes} episodes)")


def fmt_pg_clipped(curves):
    """How often the trust region (--pg_clip) bound: each seed's median over its rows of the
    share of the batch it cut, then the mean and min – max of those over seeds; "—" when no
    run logged pg_clipped (no --pg_clip)."""
    medians = [statistics.median(c.pg_clipped) for c in curves if c is not None and c.pg_clipped]
    if not medians:
        return "—"
    return (f"{statistics.fmean(medians):.1%} "
            f"({min(medians):.1%} – {max(medians):.1%}, {len(medians)} seeds)")


def fmt_collapses(curves):
    """How many seeds collapsed (Curve.collapse), and where the first of each did."""
    found = [c.collapse() for c in curves if c is not None]
    found = [f for f in found if f is not None]
    if not found:
        return "0"
    where = ", ".join(f"{fmt(peak)} to {fmt(low)} at {step / 1e6:.2f}M"
                      for step, peak, low in found)
    return f"{len(found)} ({where})"


def fmt_falls(curves):
    """All falls of all seeds (Curve.falls), a run's mean, and how many seeds fell."""
    counts = [len(c.falls()) for c in curves if c is not None]
    if not counts:
        return "—"
    return (f"{sum(counts)}, {sum(counts) / len(counts):.1f} a run "
            f"({sum(n > 0 for n in counts)} of {len(counts)} seeds)")


def fmt_deterministic(curves):
    """How many seeds' policies turned deterministic (Curve.deterministic), each time with its
    step and the training return then (a seed's times apart by ","; seeds by ";"); "—" when
    no run logged its policy's entropy."""
    found = [c.deterministic() for c in curves if c is not None and c.entropies]
    if not found:
        return "—"
    where = "; ".join(", ".join(f"{step / 1e6:.2f}M (return {fmt(value)})"
                                for step, value in events) for events in found if events)
    seeds = sum(bool(events) for events in found)
    return f"{seeds} of {len(found)} seeds" + (f": {where}" if where else "")


def fmt_sps(value):
    """Steps per second from launch to the last log row (start-up included), or n/a."""
    return f"{value:,.0f}" if math.isfinite(value) else "n/a"


def welch(a, b):
    """(mean(a) - mean(b), Welch's t, its Welch-Satterthwaite degrees of freedom) over the
    finite values of each; t and df are nan with fewer than 2 values on a side or no spread."""
    a, b = spread(a), spread(b)
    if not (a.n and b.n):
        return math.nan, math.nan, math.nan
    diff = a.mean - b.mean
    if a.n < 2 or b.n < 2:
        return diff, math.nan, math.nan
    va, vb = a.std ** 2 / a.n, b.std ** 2 / b.n
    if va + vb == 0:
        return diff, math.nan, math.nan
    df = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1))
    return diff, diff / math.sqrt(va + vb), df


def fmt_difference(name, values, base):
    """One quantity of a row against the first row's: the difference of the means over seeds,
    Welch's t (with its df), and, over the seeds both have, how many are higher seed for seed.
    values and base map seed -> that seed's value (nan where it has none)."""
    diff, t, df = welch(list(values.values()), list(base.values()))
    if not math.isfinite(diff):
        return None
    text = f"{name} {diff:+,.{RETURN_DIGITS}f}"
    if math.isfinite(t):
        text += f" (Welch t {t:.1f}, {df:.1f} df"
    else:
        text += " (no t: too few seeds or no spread"
    paired = [seed for seed in values if seed in base
              and math.isfinite(values[seed]) and math.isfinite(base[seed])]
    if paired:
        higher = sum(values[seed] > base[seed] for seed in paired)
        text += f"; higher in {higher} of {len(paired)} seeds, seed for seed"
    return text + ")"


# What each row is set against the first row by: (name in the line, a seed's value).
DIFFERENCES = [("final return", lambda c: c.final_return),
               ("checkpoint sampled return", lambda c: c.test_return("sample")),
               ("checkpoint greedy return", lambda c: c.test_return("greedy"))]


def difference_lines(names, curves_by_seed):
    """Each row after the first against the first: final return and, where both have them,
    the checkpoint's sampled and greedy test returns. curves_by_seed: row name -> {seed: Curve
    or None}."""
    if len(names) < 2:
        return []
    def per_seed(name, value):
        return {seed: (value(c) if c is not None else math.nan)
                for seed, c in curves_by_seed[name].items()}
    base = names[0]
    lines = [f"Against `{base}` (the first row):"]
    for name in names[1:]:
        parts = [fmt_difference(label, per_seed(name, value), per_seed(base, value))
                 for label, value in DIFFERENCES]
        parts = [p for p in parts if p]
        lines.append(f"- `{name}`: " + ("; ".join(parts) if parts else "no return to compare"))
    return lines + [""]


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def evaluation_curves(curves):
    """The offline evaluations of each curve that has any, as Curves of their own."""
    return [Curve(c.eval_steps, c.eval_returns, c.last_step) for c in curves if c.eval_steps]


def plot_env(env, curves_by_variant, path, points=200):
    """One PNG: per variant, the mean line and min-max band over seeds against steps."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for variant, curves in curves_by_variant.items():
        seeds = [c for c in curves if c is not None and c.steps]
        grid, mean, lo, hi = band(seeds, points)
        if not len(grid):
            continue
        line, = ax.plot(grid, mean, marker="o" if len(grid) == 1 else None,
                        label=f"{variant} (mean of {len(seeds)} seed{'s' * (len(seeds) > 1)})")
        ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn += 1
        # The policy itself, where the runs evaluated it: the mean over seeds of each
        # snapshot's evaluation, at the snapshot's step (no band: a few episodes each).
        evaluated = evaluation_curves(seeds)
        grid, mean, _, _ = band(evaluated, points)
        if len(grid):
            ax.plot(grid, mean, linestyle="--", color=line.get_color(),
                    label=f"{variant}, evaluations (mean of {len(evaluated)})")
    if not drawn:
        ax.text(0.5, 0.5, "no episode has finished yet", ha="center", transform=ax.transAxes)
    ax.set_title(f"{env}: band = min – max over seeds")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("mean return: last 100 training episodes\n(dashed: evaluations)")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def env_section(env, variants, by_run, plot_path, link, points=200):
    """The markdown of one env: its table, its figure, its failures and its reference."""
    reference = SUITE[env].reference if env in SUITE else None
    threshold = solved_threshold(env)
    rows, curves_by_seed, failures = [], {}, []
    for variant in variants:
        runs = {key[2]: by_run[key] for key in by_run if key[:2] == (env, variant)}  # by seed
        results = [result for result, _ in runs.values()]
        curves_by_seed[variant] = {seed: curve for seed, (_, curve) in runs.items()}
        rows.append(table_row(variant, results, list(curves_by_seed[variant].values()),
                              reference, threshold))
        failures += [r for r in results if r.status in ("failed", "stopped", "not run")]
    plot_env(env, {variant: list(curves.values()) for variant, curves in curves_by_seed.items()},
             plot_path, points)
    lines = [f"## {env}", "", markdown_table(TABLE_HEADER, rows), "",
             f"![{env}: mean return against steps]({link})", ""]
    lines += difference_lines(variants, curves_by_seed)
    if failures:
        lines.append("Not finished (stderr.txt and launch.json in each run folder say more):")
    for r in failures:
        lines.append(f"- `{r.spec.xpid}`: {r.status}" + (f": {r.short_error}" if r.error else ""))
    if reference or threshold is not None:
        lines += ["", "Reference:"] if lines[-1] else ["Reference:"]
    if reference:
        lines.append(f"- {reference.source}. {reference.note}")
    if threshold is not None:
        lines.append(f"- Gymnasium counts {env} as solved at a mean return of {threshold:g} "
                     "(its spec's reward_threshold): a definition, not a published result.")
    return "\n".join(lines).rstrip() + "\n"


HOW_TO_READ = (
    "Final return: `mean_episode_return` of the last logs.csv row that has one (the mean of the "
    "last 100 training episodes, sampled actions); mean ± sample std (n-1) and min – max over "
    "seeds. Checkpoint, sampled and checkpoint, greedy (with `--test_episodes`, on by "
    "default): each seed's mean return over episodes played with its final checkpoint "
    "(`--mode test`), its actions sampled from the policy as in training, or the argmax "
    "action (the Gaussian's mean, for continuous actions); mean ± std over seeds, with the "
    "seeds and episodes a seed (n/a: no seed has such a test). The sampled return differs "
    "from the final return by the older policies that the window of 100 training episodes "
    "still holds, the greedy one from the sampled by exploration: a policy that keeps more "
    "entropy scores lower sampled than greedy. "
    "Seeds finished: logs reaching total_steps. Steps reached: the last step logged, "
    "min – max over seeds. Wall time: mean over seeds, each run from its start to its last "
    "row, summed over resumes. Eval return: the `eval_mean_episode_return` of the latest "
    "snapshot (only with `--eval_interval_steps`). Curves: each seed interpolated linearly on a "
    "common step grid "
    "(the range all seeds cover); line = mean over seeds, band = min – max over seeds; a "
    "dashed line, for runs with evaluations, is the mean of their evaluations. "
    "Falls: each time a seed's 100-episode mean lost half of what it had gained over its "
    "start (its first value): below start + (best - start) / 2, counted once best - start is "
    f"at least {FALL_MIN_GAIN:.0%} of the run's largest gain (before that the curve has "
    "barely moved; a curve whose largest gain is under "
    f"{FALL_MIN_MOVE:.0%} of its start's size has none), and again only after the curve is "
    "back at "
    f"{FALL_REARM:.0%} of its best's gain; measured from the start, it counts negative "
    "returns and early dips alike; the total, the mean per seed, and the seeds with at least "
    "one. Collapses: the seeds with a fall, each with its first (from the best to the low, "
    "at the step it happened). Both pass over "
    "the rows after a resume until as many episodes as the run has environments, and 100 "
    "more, have ended: a resume starts every environment afresh, the short episodes end "
    "first, and the mean dips though nothing was unlearnt. Turned "
    "deterministic: seeds whose policy's mean entropy in a logged batch fell below "
    f"{DETERMINISTIC_NATS} nats a step (one action in nearly every state), each time with "
    "its step and the training return then; it catches the collapses that come before a "
    f"curve has gained {FALL_MIN_GAIN:.0%} of its largest gain, which the falls miss. "
    "Steps to solved "
    "(envs with a Gymnasium reward_threshold): the median over the seeds that got there of "
    "the first step where the training curve reached it, and, for runs with evaluations, "
    "where an evaluation of that step's weights did; (n/m) seeds got there. The training "
    "curve reports policies from further back the more environments a run has in flight "
    "(its episodes started earlier), so compare layouts by the evaluations or the "
    "checkpoint's returns. Trust region cut (runs with `--pg_clip`): each seed's median, over its "
    "logged rows, of `pg_clipped`, the share of the batch whose policy-gradient advantage the "
    "trust region set to 0; the mean over seeds and min – max. Against the first row (with "
    "more than one row): each other row's difference in mean final return (and the "
    "checkpoint's sampled and greedy returns), "
    "Welch's t of it with its degrees of freedom (unequal variances; with 3 seeds a side, |t| "
    "above about 2.8 is the two-sided 5% level at 4 df, and 3 seeds tell apart only large "
    "effects), and in how many of the seeds both rows ran the row is higher seed for seed.")


def row_name(variant, label):
    """A table row's and a curve's name: the variant, and the label of its savedir if any."""
    return f"{variant}, {label}" if label else variant


def parse_compare(items):
    """--compare LABEL=SAVEDIR items -> [(label, absolute savedir)]; ValueError if malformed."""
    groups = []
    for item in items:
        label, sep, savedir = item.partition("=")
        if not sep or not label.strip() or not savedir.strip():
            raise ValueError(f"--compare {item!r}: expected LABEL=SAVEDIR, e.g. "
                             "'pg_clip 0.4=~/logs/clip04'")
        groups.append((label.strip(), os.path.abspath(os.path.expanduser(savedir.strip()))))
    return groups


def report_groups(args, results):
    """[(label, savedir, results)]: this launch's runs, then those of each --compare savedir,
    read as the same grid (same envs, variants and seeds; nothing is launched there)."""
    groups = [(args.label, args.savedir, results)]
    for label, savedir in parse_compare(args.compare):
        groups.append((label, savedir, [launch.load_result(r.spec, savedir) for r in results]))
    return groups


def report(args, argv, results, plot_dir, link_base):
    """The whole markdown report; writes one PNG per env into plot_dir."""
    by_run, names = {}, []
    for label, savedir, group in report_groups(args, results):
        for variant in launch.split_list(args.variants):
            if row_name(variant, label) not in names:
                names.append(row_name(variant, label))
        for r in group:
            by_run[(r.spec.env, row_name(r.spec.variant, label), r.spec.seed)] = (
                r, read_curve(launch.run_dir(r.spec, savedir)))
    os.makedirs(plot_dir, exist_ok=True)
    sections = []
    for env in launch.split_list(args.envs):
        plot_path = os.path.join(plot_dir, env.replace("/", "-") + ".png")
        link = os.path.relpath(plot_path, link_base) if link_base else plot_path
        sections.append(env_section(env, names, by_run, plot_path, link, args.points))
    command = shlex.join(["python", "-m", "bench.learn", *argv])
    where = "".join(f", and `{savedir}` ({label})"
                    for label, savedir in parse_compare(args.compare))
    return "\n".join([
        "# Learning benchmark", "",
        f"`{command}`, {time.strftime('%Y-%m-%d %H:%M')}, runs in `{args.savedir}`{where}.",
        "", HOW_TO_READ, "", *sections])


# ---------------------------------------------------------------------------------------------
# The command line.

def describe_steps():
    """The suite's total_steps as help text, read from SUITE and ENV_DEFAULTS."""
    envs_by_steps = {}
    for env, spec in SUITE.items():
        envs_by_steps.setdefault(spec.total_steps, []).append(env)
    vector = beast_flags.ENV_DEFAULTS["vector"]["total_steps"]
    return "; ".join(
        f"{steps:,} for {', '.join(envs)}" if steps is not None else
        f"the repo's default for {', '.join(envs)} ({vector:,} for vector tasks)"
        for steps, envs in envs_by_steps.items())


def make_parser():
    parser = argparse.ArgumentParser(
        prog="python -m bench.learn",
        usage="python -m bench.learn [options] [-- flags for every run]",
        description="Train the learning suite (envs x variants x seeds; resumable) and write "
                    "a markdown report: final returns over seeds, steps, wall time, and a "
                    "PNG of the learning curves per environment. Everything after `--` is "
                    "passed to every run.",
        formatter_class=beast_flags.HelpFormatter)
    launch.add_grid_flags(parser, envs=",".join(SUITE), seeds="0,1,2",
                          savedir="~/logs/beast-learn", total_steps_default=describe_steps())
    group = parser.add_argument_group("report")
    group.add_argument("--output", default=None,
                       help="Markdown report to write (default: print it).")
    group.add_argument("--plot_dir", default=None,
                       help="Where the PNGs go (default: plots/ beside --output, or in "
                            "the savedir when the report is printed).")
    group.add_argument("--points", type=int, default=200,
                       help="Steps of the common grid the curves are interpolated on.")
    group.add_argument("--no_launch", action="store_true",
                       help="Launch nothing (no training, no test): report on the runs "
                            "already in the savedir.")
    group.add_argument("--compare", action="append", default=[], metavar="LABEL=SAVEDIR",
                       help="Also report the same grid's runs in SAVEDIR (envs, variants and "
                            "seeds as here; nothing is launched or tested there), as rows and "
                            "curves named 'VARIANT, LABEL' beside this savedir's: an ablation "
                            "in one table and one figure. Repeatable.")
    group.add_argument("--label", default="",
                       help="With --compare: the label of this savedir's rows and curves "
                            "(default: none, the variant alone).")
    group.add_argument("--test_episodes", type=int, default=100,
                       help="Once the runs are done, play this many episodes with each "
                            "finished run's final checkpoint, once sampling its actions and "
                            "once greedy (two `--mode test`s, kept in its tests.jsonl; a "
                            "policy tested before with as many episodes at that checkpoint "
                            "is not played again), and report their mean over seeds beside "
                            "the final return. 0: none.")
    return parser


def suite_grid(args):
    """The RunSpecs: the suite's per-env total_steps and args, then the command line's."""
    envs = launch.split_list(args.envs)
    return launch.grid_from_args(
        args,
        total_steps={env: SUITE[env].total_steps for env in envs if env in SUITE},
        env_args={env: SUITE[env].args for env in envs if env in SUITE})


def run_suite(args, specs):
    """The RunResults: launched (or, with --no_launch, read from the run folders)."""
    if args.no_launch:
        return [launch.load_result(spec, args.savedir) for spec in specs]
    with launch.stop_on_signals():
        return launch.run_grid(specs, args.savedir, args.parallel,
                               stop_timeout_s=args.stop_timeout_s)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    args = launch.parse_args(parser, argv)
    try:  # before any run is launched: a typo must not wait for the report
        compare = parse_compare(args.compare)
    except ValueError as e:
        parser.error(str(e))
    missing = [d for _, d in compare if not os.path.isdir(d)]
    if missing:
        parser.error(f"--compare: no such savedir: {', '.join(missing)}")
    labels = [args.label] + [label for label, _ in compare]
    if compare and len(set(labels)) < len(labels):
        parser.error(f"--label and --compare need a different label each (got {labels}): "
                     "the rows and curves are named by them")
    try:
        results = run_suite(args, suite_grid(args))
        if not args.no_launch:
            test_runs(results, args.savedir, args.test_episodes)
    except KeyboardInterrupt:
        launch.progress("stopped; run the same command again to resume")
        return 130
    if args.output:
        base = os.path.dirname(os.path.abspath(args.output))
        plot_dir = args.plot_dir or os.path.join(base, "plots")
    else:
        base, plot_dir = None, args.plot_dir or os.path.join(args.savedir, "plots")
    text = report(args, argv, results, plot_dir, base)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        launch.progress(f"wrote {args.output} and the PNGs in {plot_dir}")
    else:
        print(text)
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
