"""EnvPool's Atari, as Cleanba's IMPALA makes it, beside ours (beast/atari_wrappers.py, what
`python -m monobeast --env ALE/Breakout-v5 --full_action_space --noop_max 0` trains on): do the
agents see the same observations, rewards and episode ends?

    python -m bench.envpool_frames                    # Breakout, about 15 s on 2 cores
    python -m bench.envpool_frames --game Pong --sticky_episodes 0
    python -m bench.envpool_frames --csv /tmp/breakout.csv --show 30

Needs EnvPool (pip install envpool). EnvPool is made with Cleanba's arguments (cleanba_impala.py
`make_env`: episodic_life=False, noop_max=1, full_action_space=True, reward_clip=True,
max_episode_steps=27000 agent steps, EnvPool's defaults otherwise: frame skip 4, max of the last
two frames, 84x84 grey by INTER_AREA, a stack of 4, FIRE on reset) and ours with the flags that
ask for the same (--full_action_space --noop_max 0 --no-episodic_life, rewards clipped by the
learner's --reward_clipping abs_one). EnvPool's noop_max=1 draws no no-op frame: it takes
uniform(0, noop_max - 1) + 1 no-op frames, less the one that FIRE on reset replaces.

Two sections:
  1. Sticky actions off on both (repeat_action_probability 0): the emulators are then
     deterministic, so one seeded sequence of uniformly random actions (of all 18) must give
     both the same frames. It is played twice, each time in lockstep with a fresh EnvPool env:
     against ours, then against ours with EnvPool's sequence of emulator calls at a reset and
     at a game's end (`EnvPoolSequence`), which tells what any difference comes from. Per step:
     whether the uint8 [4, 84, 84] stacks are equal (both oldest frame first), their max and
     mean absolute pixel difference, whether the emulators' RAM is equal, whether the rewards
     are (clipped, as each learner takes them, and raw) and whether the done flags are. A step
     whose done flags disagree starts new games in both. Summed up by kind of frame: a reset's,
     mid-game, a game's last; --csv writes every step, --show prints the first few.
  2. Sticky actions on (0.25) on both: their random numbers differ, so only distributions
     compare: the length and return of --sticky_episodes games of uniformly random actions in
     each (drawn from one seeded stream in both). Which action the emulator played on a frame is
     visible through neither API.
"""

import argparse
import csv
import statistics
import sys
import time

import ale_py
import numpy as np

from beast import atari_wrappers
from beast import envs
from beast import flags as beast_flags
from beast import machine

NUM_ACTIONS = 18  # the full action set
MAX_EPISODE_STEPS = atari_wrappers.MAX_FRAMES_PER_EPISODE // 4  # Cleanba's ATARI_MAX_FRAMES


def make_envpool(game, sticky, seed):
    """One EnvPool env as cleanba_impala.py `make_env` makes it (Gymnasium's API: EnvPool 1.x
    serves env_type="gym" with it too)."""
    import envpool

    return envpool.make(f"{game}-v5", env_type="gymnasium", num_envs=1, num_threads=1,
                        episodic_life=False, repeat_action_probability=sticky, noop_max=1,
                        full_action_space=True, max_episode_steps=MAX_EPISODE_STEPS,
                        reward_clip=True, seed=seed)


def make_ours(game, sticky):
    """Our env as monobeast makes it for --env ALE/<game>-v5 --full_action_space --noop_max 0."""
    parser = beast_flags.add_env_flags(argparse.ArgumentParser())
    flags = parser.parse_args([f"--env=ALE/{game}-v5", "--full_action_space", "--noop_max=0",
                               "--no-episodic_life", f"--repeat_action_probability={sticky}"])
    return envs.create_env(flags)


class EnvPoolSequence(atari_wrappers.AtariPreprocessing):
    """Ours, with EnvPool's emulator calls (envpool/atari/atari_env.h, AtariEnv::Reset and
    ::Step) where they differ:

      * reset: FIRE for one frame (ours: one agent step, 4 frames, the last two max-pooled), the
        screen after it unpooled; with no FIRE in the action set, one NOOP frame instead;
      * a game that ends before the last frame of a step: EnvPool stops grabbing screens, so the
        frame it pushes is the previous step's (ended on frame 1 or 2) or frame 3's unpooled
        (ended on frame 3); ours pushes the final screen.

    Only for noop_max=1 and episodic_life=False, Cleanba's settings.
    """

    def _real_reset(self, seed):
        self.env.reset(seed=seed)
        ale = self.ale
        ale.act(self._noop if self._fire is None else self._fire)
        ale.getScreenGrayscale(self._screens[0])
        self._screens[1] = self._screens[0]
        self._lives = ale.lives()
        return self._push_frame(fill=True)

    def _repeat(self, ale_action):
        ale = self.ale
        reward = 0.0
        for i in range(self.frame_skip):
            reward += ale.act(ale_action)
            if i >= self.frame_skip - 2:
                ale.getScreenGrayscale(self._screens[i - (self.frame_skip - 2)])
            if ale.game_over():
                if i < self.frame_skip - 2:  # no screen grabbed: the last pushed one again
                    self._screens[0] = self._max_screen
                    self._screens[1] = self._max_screen
                elif i == self.frame_skip - 2:  # one grabbed: no max-pool
                    self._screens[1] = self._screens[0]
                break
        return reward


def lockstep(ours, pool, actions, seed, label):
    """Plays `actions` in ours and in EnvPool's env at once. Returns one dict per step (a
    reset's frame is a step of kind "reset", with no action)."""
    rows = []

    def row(kind, action, frames, theirs, ram, their_ram, reward=0.0, their_raw=0.0,
            their_reward=0.0, done=False, their_done=False):
        diff = np.abs(frames.astype(np.int16) - theirs.astype(np.int16))
        clipped = float(np.sign(reward))  # the learner's abs_one on Atari's integer rewards
        rows.append(dict(
            run=label, index=len(rows), kind=kind, action="" if action is None else action,
            stack_equal=int(not diff.any()), max_abs=int(diff.max()),
            mean_abs=round(float(diff.mean()), 4), ram_equal=int(np.array_equal(ram, their_ram)),
            reward=reward, envpool_reward_raw=their_raw, envpool_reward=their_reward,
            rewards_equal=int(clipped == their_reward), raw_rewards_equal=int(reward == their_raw),
            done=int(done), envpool_done=int(their_done), done_equal=int(done == their_done)))

    frames, _ = ours.reset(seed=seed)
    theirs, info = pool.reset()
    row("reset", None, frames, theirs[0], ours.ale.getRAM(), info["ram"][0])
    for action in actions:
        frames, reward, terminated, truncated, _ = ours.step(int(action))
        theirs, their_reward, their_term, their_trunc, info = pool.step(
            np.array([action], dtype=np.int32))
        done = terminated or truncated
        their_done = bool(their_term[0] or their_trunc[0])
        row("step", int(action), frames, theirs[0], ours.ale.getRAM(), info["ram"][0],
            float(reward), float(info["reward"][0]), float(their_reward[0]), done, their_done)
        if done or their_done:
            rows[-1]["kind"] = "last"
            frames, _ = ours.reset()
            if their_done:  # EnvPool starts the new game on the next step, ignoring its action
                theirs, _, _, _, info = pool.step(np.zeros(1, dtype=np.int32))
            else:
                theirs, info = pool.reset()
            row("reset", None, frames, theirs[0], ours.ale.getRAM(), info["ram"][0])
    ours.close()
    pool.close()
    return rows


def summary(rows, title):
    lines = [title, "",
             "| frames | count | stacks equal | max abs diff | mean abs diff | RAM equal | "
             "rewards equal (clipped; raw) | done equal |", "|---|---|---|---|---|---|---|---|"]
    for name, kinds in (("a reset's", {"reset"}), ("mid-game", {"step"}),
                        ("a game's last", {"last"}), ("all", {"reset", "step", "last"})):
        some = [r for r in rows if r["kind"] in kinds]
        if not some:
            continue
        stepped = [r for r in some if r["kind"] != "reset"]
        rewards = (f"{sum(r['rewards_equal'] for r in stepped):,}; "
                   f"{sum(r['raw_rewards_equal'] for r in stepped):,}" if stepped else "")
        done = f"{sum(r['done_equal'] for r in stepped):,}" if stepped else ""
        lines.append(
            f"| {name} | {len(some):,} | {sum(r['stack_equal'] for r in some):,} | "
            f"{max(r['max_abs'] for r in some)} | "
            f"{statistics.mean(r['mean_abs'] for r in some):.3f} | "
            f"{sum(r['ram_equal'] for r in some):,} | {rewards} | {done} |")
    differ = [r["index"] for r in rows if not r["stack_equal"]]
    kinds = [rows[i]["kind"] for i in differ[:5]]
    lines += ["", f"Episodes: {sum(r['kind'] == 'reset' for r in rows) - 1} ended; "
              f"first stacks that differ: {list(zip(differ[:5], kinds)) or 'none'}; done flags "
              f"that disagree: {sum(1 - r['done_equal'] for r in rows)}."]
    return "\n".join(lines)


def section_exact(game, steps, seed, show, csv_path):
    actions = np.random.default_rng(seed).integers(NUM_ACTIONS, size=steps)
    runs = [("ours", make_ours(game, 0.0)),
            ("ours+envpool_sequence", EnvPoolSequence(make_ours(game, 0.0).unwrapped, noop_max=0))]
    all_rows, out = [], []
    for label, ours in runs:
        start = time.monotonic()
        rows = lockstep(ours, make_envpool(game, 0.0, seed), actions, seed, label)
        all_rows += rows
        out.append(summary(rows, f"{label} against EnvPool, {game}, sticky actions off, "
                                 f"{steps:,} random actions (seed {seed}), "
                                 f"{time.monotonic() - start:.0f} s"))
    if show:
        keys = ["index", "kind", "action", "stack_equal", "max_abs", "mean_abs", "ram_equal",
                "reward", "envpool_reward", "rewards_equal", "done", "envpool_done"]
        table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        table += ["| " + " | ".join(str(r[k]) for k in keys) + " |"
                  for r in all_rows if r["run"] == "ours"][:show]
        out.append(f"The first {show} rows of ours against EnvPool:\n\n" + "\n".join(table))
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(all_rows[0]))
            writer.writeheader()
            writer.writerows(all_rows)
        out.append(f"Every step: {csv_path}")
    return "\n\n".join(out)


def play_episodes(step, reset, episodes, rng):
    """[(raw return, clipped return, agent steps)] of `episodes` games of uniformly random
    actions. step(action) -> (raw reward, done); reset() starts a game."""
    played = []
    for _ in range(episodes):
        reset()
        total, clipped, length, done = 0.0, 0.0, 0, False
        while not done:
            reward, done = step(int(rng.integers(NUM_ACTIONS)))
            total, clipped, length = total + reward, clipped + float(np.sign(reward)), length + 1
        played.append((total, clipped, length))
    return played


def section_sticky(game, episodes, seed):
    ours = make_ours(game, 0.25)
    seeds = iter(range(seed, seed + episodes))

    def ours_step(action):
        _, reward, terminated, truncated, _ = ours.step(action)
        return float(reward), terminated or truncated

    pool = make_envpool(game, 0.25, seed)
    pending = [False]  # EnvPool starts the next game on the step after a game's end

    def pool_reset():
        if pending[0]:
            pool.step(np.zeros(1, dtype=np.int32))
        else:
            pool.reset()
        pending[0] = False

    def pool_step(action):
        _, _, terminated, truncated, info = pool.step(np.array([action], dtype=np.int32))
        pending[0] = bool(terminated[0] or truncated[0])
        return float(info["reward"][0]), pending[0]

    lines = [f"{game}, sticky actions 0.25 on both, {episodes} games of uniformly random actions "
             "each (all 18)", "",
             "| | return, mean ± sd (min - max) | clipped return | length in agent steps, "
             "mean ± sd (min - max) | s |", "|---|---|---|---|---|"]
    for label, step, reset in (("ours", ours_step, lambda: ours.reset(seed=next(seeds))),
                               ("EnvPool", pool_step, pool_reset)):
        start = time.monotonic()
        played = play_episodes(step, reset, episodes, np.random.default_rng(seed))
        cells = []
        for column in range(3):
            values = [p[column] for p in played]
            cells.append(f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f} "
                         f"({min(values):g} - {max(values):g})")
        lines.append(f"| {label} | " + " | ".join(cells) +
                     f" | {time.monotonic() - start:.0f} |")
    ours.close()
    pool.close()
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--game", default="Breakout",
                        help="The game, as EnvPool names it (Breakout, Pong, SpaceInvaders); "
                             "ours plays ALE/<game>-v5.")
    parser.add_argument("--steps", type=int, default=3000,
                        help="Random actions of section 1 (sticky actions off), played twice.")
    parser.add_argument("--sticky_episodes", type=int, default=20,
                        help="Games of section 2 (sticky actions on) in each env; 0 skips it.")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seeds the actions, EnvPool (its seed=) and our first game.")
    parser.add_argument("--show", type=int, default=0,
                        help="Print the first this many steps of ours against EnvPool.")
    parser.add_argument("--csv", default=None,
                        help="Write every step of section 1 to this CSV file.")
    args = parser.parse_args(argv)
    try:
        import envpool
    except ImportError:
        print("error: needs EnvPool: pip install envpool", file=sys.stderr)
        return 2
    import cv2  # only for its version: beast/atari_wrappers.py is what calls it

    cpu, _ = machine.this_cpu()
    print(f"# EnvPool's Atari beside ours\n\nCPU: {cpu}, {machine.cores()} cores; EnvPool "
          f"{envpool.__version__} (its own ALE and OpenCV inside), ale-py {ale_py.__version__}, "
          f"OpenCV {cv2.__version__}, NumPy {np.__version__}\n", flush=True)
    print(section_exact(args.game, args.steps, args.seed, args.show, args.csv) + "\n",
          flush=True)
    if args.sticky_episodes > 0:
        print(section_sticky(args.game, args.sticky_episodes, args.seed) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
