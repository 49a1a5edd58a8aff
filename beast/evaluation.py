"""Playing whole games with a model: offline evaluation during training (Evaluator) and
--mode test (training.test)."""

import sys
import threading

import numpy as np
import torch

from beast import envs
from beast import runlog
from beast import vector_envs
from beast import video


class BadStep(ValueError):
    """An evaluation environment returned a reward or observation that is not finite."""


def checked(env_output, env_id):
    """env_output, once its rewards and observations are known to be finite (as the
    actors check theirs: vector_envs.nonfinite_problem)."""
    problem = vector_envs.nonfinite_problem(
        {k: np.asarray(v)[None] for k, v in env_output.items()}, env_id)
    if problem is not None:
        raise BadStep(f"evaluation: {problem}")
    return env_output


def play_episodes(flags, model, num_episodes, seed, video_paths=(), progress=None):
    """Plays whole games with `model` on fresh environments; returns their returns.

    With --eval_policy greedy (the default) the model acts greedily, in eval mode (the argmax
    of the policy), as TorchBeast's test mode does; with sample, in train mode.
    Up to --eval_envs environments play at once, one forward pass for all of them. Each
    plays a share of the games fixed before any starts (game_shares): taking the first games
    to end would favour the short ones, and in most games a short game is a poor one.
    Returns are in environment order (the first environment's games first).
    video_paths: MP4 files for the screens of the first games in that order.
    progress: None, or a GameProgress shown after every step of the environments.
    A game longer than --eval_max_steps is stopped there and counts with its return so far,
    with a warning: a greedy policy can play some games without end (MinAtar's have no time
    limit), and an evaluation that never ends would never be logged.
    """
    shares = game_shares(num_episodes, flags.eval_envs)
    firsts = np.cumsum([0] + shares)  # the place of each environment's first game
    games = [envs.RolloutAdapter(video.create_env(flags, video_paths[first:first + share]),
                                 seed=env_seed(seed, i))
             for i, (first, share) in enumerate(zip(firsts, shares))]
    model.train(flags.eval_policy == "sample")
    returns = [[] for _ in games]
    steps = 0
    try:
        outputs = [checked(game.initial(), flags.env) for game in games]
        states = [model.initial_state(1) for _ in games]
        while playing := [i for i, share in enumerate(shares) if len(returns[i]) < share]:
            actions = act_together(model, [outputs[i] for i in playing],
                                   [states[i] for i in playing])
            for i, (action, state) in zip(playing, actions):
                states[i] = state
                outputs[i] = checked(games[i].step(action), flags.env)
                if record_game_end(flags, outputs[i], returns[i]):
                    outputs[i] = checked(games[i].initial(), flags.env)
                    states[i] = model.initial_state(1)
            steps += len(playing)
            if progress is not None:
                progress.update(steps, returns)
    finally:
        for game in games:
            game.close()
    return [r for env_returns in returns for r in env_returns]


class GameProgress(runlog.StatusLine):
    """--mode test's progress on the status line: the games finished of all, the environment
    steps played and their rate, the mean return of the finished games, so that a test of
    many long games (Atari's, on one core) shows how far it has got."""

    def __init__(self, num_episodes, eval_policy, **kwargs):
        super().__init__(total_steps=None, label=f"test, {eval_policy}", **kwargs)
        self.num_episodes = num_episodes

    def update(self, step, returns_per_env=()):
        """returns_per_env: each environment's list of returns, read only when a line is due."""
        super().update(step, {"returns_per_env": returns_per_env})

    def _format(self, step, stats, sps):
        returns = [r for env_returns in stats["returns_per_env"] for r in env_returns]
        parts = [self.label, f"games {len(returns)}/{self.num_episodes}",
                 f"steps {step:,}", f"SPS {sps:.0f}"]
        if returns:
            parts.append(f"mean return so far {np.mean(returns):.2f}")
        return " | ".join(parts)


def game_shares(num_episodes, max_envs):
    """How many games each environment plays: num_episodes spread over at most max_envs,
    as evenly as they go (the first ones one more)."""
    num_envs = max(1, min(num_episodes, max_envs))
    return [num_episodes // num_envs + (i < num_episodes % num_envs) for i in range(num_envs)]


def env_seed(seed, index):
    """The seed of evaluation environment `index`: `seed` for the first, for the others a
    seed drawn from (seed, index), so that evaluations with nearby seeds share no game."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0] >> 1)


def act_together(model, env_outputs, states):
    """One forward pass over several environments: [(action, core state)] of each.
    env_outputs: one step's dict each; states: each environment's core state ([L, 1, H]
    tensors, or () without a core)."""
    inputs = {k: torch.as_tensor(np.stack([np.asarray(o[k]) for o in env_outputs]))[None]
              for k in env_outputs[0]}
    joined = tuple(torch.cat(parts, dim=1) for parts in zip(*states))
    with torch.no_grad():
        output, joined = model(inputs, joined)
    actions = output["action"][0].numpy()  # an int64 each, or float32 [A]
    return [(actions[b], tuple(s[:, b:b + 1] for s in joined)) for b in range(len(states))]


def record_game_end(flags, env_output, returns):
    """Appends the return of a game that this step ends, at game over or at --eval_max_steps
    (with a warning). Returns True for a game stopped at --eval_max_steps, which the caller
    starts afresh; after a game over the adapter starts the next game itself."""
    max_steps = flags.eval_max_steps
    if env_output["game_over"]:
        returns.append(float(env_output["episode_return"]))
        return False
    if 0 < max_steps <= env_output["episode_step"]:
        returns.append(float(env_output["episode_return"]))
        print(f"warning: a game stopped at --eval_max_steps {max_steps:,}, with a return "
              f"of {returns[-1]:g} so far.", file=sys.stderr)
        return True
    return False


class Evaluator:
    """Offline evaluation (as in rlpyt): every --eval_interval_steps, a few
    episodes on separate environments, logged apart from training episodes; every
    --eval_video_interval_steps, one game recorded as an MP4 (beast/video.py).

    A learner thread takes a snapshot of the weights when a step crosses the
    interval (snapshot_if_due); the main thread plays the episodes later
    (run_pending), so learning never waits for them and no evaluation is
    skipped however fast training runs.
    """

    def __init__(self, flags, make_model, start_step, enabled=True, videos_dir=None):
        self.flags = flags
        self.make_model = make_model  # () -> a fresh model to load the snapshots into
        self.videos_dir = videos_dir
        # Two schedules, evaluations and videos (--eval_video_interval_steps: one recorded
        # game, in videos_dir); a snapshot serves whichever is due. An interval of 0 is off.
        self.intervals = (flags.eval_interval_steps,
                          flags.eval_video_interval_steps if videos_dir else 0)
        self.enabled = enabled and any(i > 0 for i in self.intervals)
        self.next_steps = [start_step + i if i > 0 else float("inf") for i in self.intervals]
        self.model = None
        self.lock = threading.Lock()
        # (step, weights, evaluate, record) waiting to be played, oldest first. GUARDED_BY(lock)
        self.pending = []
        self.count = 0

    def snapshot_if_due(self, step, learner_):
        if not self.enabled or step < min(self.next_steps):
            return
        with self.lock:
            due = [step >= next_step for next_step in self.next_steps]
            if not any(due):  # another learner thread took it
                return
            for k, interval in enumerate(self.intervals):
                while self.next_steps[k] <= step:
                    self.next_steps[k] += interval
        weights = learner_.weights()
        with self.lock:
            # A few at most: if playing falls far behind, the oldest go unplayed.
            self.pending = self.pending[-3:] + [(step, weights, *due)]

    def run_pending(self, stats):
        with self.lock:
            pending, self.pending = self.pending, []
        for step, weights, evaluate, record in pending:
            if self.model is None:
                self.model = self.make_model()
            self.model.load_state_dict(weights)
            self.count += 1
            paths = [video.path_for_eval(self.videos_dir, step)] if record else []
            # A video alone is one game; with an evaluation, its first game.
            games = self.flags.eval_episodes if evaluate else 1
            seed = 10_000_000 + self.count
            try:
                returns = play_episodes(self.flags, self.model, games, seed, video_paths=paths)
            except video.VideoError as e:  # a full disk, say: no reason to end the run
                print(f"warning: {e}. Training goes on.", file=sys.stderr)
                if not evaluate:
                    continue
                paths = []
                returns = play_episodes(self.flags, self.model, games, seed)
            row = {"video_episode_return": returns[0]} if paths else {}
            if evaluate:
                row.update(eval_mean_episode_return=float(np.mean(returns)),
                           eval_episodes=len(returns), eval_policy=self.flags.eval_policy)
            stats.log(step, row, videos={"eval_video": paths[0]} if paths else None)
