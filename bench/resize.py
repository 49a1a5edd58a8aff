"""The Atari screen: OpenCV's INTER_AREA resize beside an area average in NumPy, and our Atari
preprocessing (beast/atari_wrappers.py) beside Gymnasium's AtariPreprocessing, on Pong.

    python -m bench.resize            # about 1.5 minutes on 2 cores
    python -m bench.resize --quick    # about 15 seconds

Prints a markdown report with the machine (CPU model, cores) and four tables:
  1. Per call, one 210x160 uint8 grayscale Pong screen -> uint8 84x84: `resize_screen` (OpenCV)
     and `NumpyAreaResize` (an area average by gathers and multiply-adds, rounded to uint8 as an
     actor stores it), timed in this process in blocks of calls whose order alternates; wall
     and CPU microseconds per call, median (min - max) over the blocks.
  2. Their outputs on the screens of random play of a few games and on random images: pixels
     that differ, by how much, and how far the exact area mean (float64) lies from a rounding
     tie (k + 0.5) there.
  3. Agent steps/s of the whole preprocessing on ALE/Pong-v5 (sticky actions, random actions,
     one process), over the wall time and over the CPU time: ours with OpenCV, ours with the
     NumPy resize, and Gymnasium's AtariPreprocessing + FrameStackObservation(4), in chunks
     whose order alternates.
  4. Frames of ours against Gymnasium's for the same seed and actions (Gymnasium's env presses
     FIRE once after each reset, which ours does inside reset), and what a lost life does with
     Gymnasium's terminal_on_life_loss=True on Breakout.
"""

import argparse
import contextlib
import statistics
import time
import types

import ale_py
import gymnasium
import numpy as np

from beast import atari_wrappers
from beast import machine

SCREEN = (210, 160)
SIZE = 84


class NumpyAreaResize:
    """A 2-D area average (INTER_AREA's definition) as separable taps: every output row
    (column) is a weighted sum of the at most ceil(scale) + 1 input rows (columns) it covers.
    __call__ rounds to uint8, as an actor's frame is stored."""

    def __init__(self, in_shape, out_shape):
        self.row_index, self.row_weight = self._taps(in_shape[0], out_shape[0])
        self.col_index, self.col_weight = self._taps(in_shape[1], out_shape[1])
        self.row_weight = self.row_weight[:, :, None]  # broadcast over columns
        self.out = np.empty(out_shape, dtype=np.uint8)

    @staticmethod
    def _taps(n_in, n_out):
        """index, weight [taps, n_out]: out[o] = sum_k weight[k, o] * in[index[k, o]]."""
        scale = n_in / n_out
        edges = np.arange(n_out + 1) * scale
        pixel = np.arange(n_in)[None, :]
        overlap = np.minimum(edges[1:, None], pixel + 1) - np.maximum(edges[:-1, None], pixel)
        weight = np.clip(overlap, 0.0, None) / scale
        num_taps = int((weight > 0).sum(axis=1).max())
        index = np.zeros((num_taps, n_out), dtype=np.intp)
        tap_weight = np.zeros((num_taps, n_out), dtype=np.float32)
        for o in range(n_out):
            (covered,) = np.nonzero(weight[o])
            index[: len(covered), o] = covered
            tap_weight[: len(covered), o] = weight[o, covered]
        return index, tap_weight

    def mean(self, image):
        """float32 [H_out, W_out], not rounded."""
        rows = image[self.row_index]  # [taps, H_out, W_in]
        out = self.row_weight[0] * rows[0]
        for k in range(1, len(rows)):
            out += self.row_weight[k] * rows[k]
        cols = out[:, self.col_index]  # [H_out, taps, W_out]
        result = self.col_weight[0] * cols[:, 0]
        for k in range(1, cols.shape[1]):
            result += self.col_weight[k] * cols[:, k]
        return result

    def __call__(self, image, size=None):
        small = self.mean(image)
        small += 0.5  # round to nearest: the assignment truncates
        self.out[...] = small
        return self.out.copy()


def exact_area_mean(image):
    """float64 [84, 84] for a 210x160 image, from the definition: upsample to a common
    multiple (210 * 2 = 84 * 5, 160 * 21 = 84 * 40), then average the blocks."""
    up = np.repeat(np.repeat(image.astype(np.float64), 2, axis=0), 21, axis=1)
    return up.reshape(SIZE, 5, SIZE, 40).mean(axis=(1, 3))


def make_atari(game="pong", repeat_action_probability=0.25):
    return ale_py.AtariEnv(game=game, obs_type="grayscale", frameskip=1,
                           repeat_action_probability=repeat_action_probability,
                           max_num_frames_per_episode=atari_wrappers.MAX_FRAMES_PER_EPISODE)


def ours(game="pong"):
    return atari_wrappers.AtariPreprocessing(make_atari(game))


GAMES = ("pong", "breakout", "space_invaders", "seaquest", "ms_pacman")


def gymnasiums(game="pong", terminal_on_life_loss=False, stack=True):
    env = gymnasium.wrappers.AtariPreprocessing(make_atari(game), noop_max=30, frame_skip=4,
                                                screen_size=SIZE,
                                                terminal_on_life_loss=terminal_on_life_loss)
    return gymnasium.wrappers.FrameStackObservation(env, 4) if stack else env


@contextlib.contextmanager
def numpy_resize():
    """beast/atari_wrappers.py resizes with NumpyAreaResize inside the block."""
    real = atari_wrappers.resize_screen
    atari_wrappers.resize_screen = NumpyAreaResize(SCREEN, (SIZE, SIZE))
    try:
        yield
    finally:
        atari_wrappers.resize_screen = real


def pong_screens(count, seed=0, game="pong"):
    """Yields `count` max-pooled grayscale screens of random play, as the preprocessing resizes
    them (each a view, rewritten by the next step)."""
    env = ours(game)
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(count):
        _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        yield env._max_screen
        if terminated or truncated:
            env.reset()
    env.close()


def spread(values, digits=1):
    return (f"{statistics.median(values):,.{digits}f} "
            f"({min(values):,.{digits}f} - {max(values):,.{digits}f})")


def time_calls(functions, screens, blocks, calls):
    """{name: (wall us per call per block, CPU us per call per block)}, the functions' order
    reversed every other block."""
    results = {name: ([], []) for name in functions}
    names = list(functions)
    for block in range(blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            function = functions[name]
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(calls):
                function(screens[i % len(screens)], SIZE)
            results[name][0].append((time.perf_counter() - wall) / calls * 1e6)
            results[name][1].append((time.process_time() - cpu) / calls * 1e6)
    return results


def section_per_call(screens, blocks, calls):
    functions = {"cv2.resize(INTER_AREA) (resize_screen)": atari_wrappers.resize_screen,
                 "NumpyAreaResize": NumpyAreaResize(SCREEN, (SIZE, SIZE))}
    results = time_calls(functions, screens, blocks, calls)
    rows = [f"| {name} | {spread(wall)} | {spread(cpu)} |"
            for name, (wall, cpu) in results.items()]
    return "\n".join([
        f"1. One call, 210x160 uint8 -> 84x84 uint8 ({blocks} blocks of {calls} calls, "
        "alternating)", "",
        "| resize | wall us/call | CPU us/call |", "|---|---|---|", *rows])


def compare_outputs(images):
    """(images, images that differ, pixels that differ, max abs difference, the largest distance
    of the exact area mean from k + 0.5 where they differ) of resize_screen against
    NumpyAreaResize."""
    numpy_resize = NumpyAreaResize(SCREEN, (SIZE, SIZE))
    count = images_differ = differ = worst = 0
    tie_distance = 0.0
    for image in images:
        a = atari_wrappers.resize_screen(image, SIZE).astype(np.int16)
        b = numpy_resize(image).astype(np.int16)
        where = a != b
        count += 1
        images_differ += bool(where.any())
        differ += int(where.sum())
        worst = max(worst, int(np.abs(a - b).max()))
        if where.any():
            exact = exact_area_mean(image)[where]
            tie_distance = max(tie_distance, float(np.abs(exact % 1.0 - 0.5).max()))
    return count, images_differ, differ, worst, tie_distance


def section_outputs(pong_steps, game_steps, random_images, seed=0):
    rng = np.random.default_rng(seed)
    groups = [(f"{game} screens of random play", pong_screens(
        pong_steps if game == "pong" else game_steps, seed, game)) for game in GAMES]
    groups.append(("random images", (rng.integers(0, 256, SCREEN, dtype=np.uint8)
                                     for _ in range(random_images))))
    rows = []
    for label, images in groups:
        count, images_differ, differ, worst, tie_distance = compare_outputs(images)
        rows.append(f"| {label} | {images_differ:,} of {count:,} | "
                    f"{differ:,} of {count * SIZE * SIZE:,} | {worst} | {tie_distance:.2g} |")
    return "\n".join([
        "2. Outputs: cv2.resize against NumpyAreaResize", "",
        "| images | images that differ | pixels that differ | max abs difference | largest "
        "distance of the exact mean from k + 0.5 where they differ |", "|---|---|---|---|---|",
        *rows])


def steps_per_second(env, steps, rng):
    """(wall, CPU) agent steps/s of `steps` random actions (an episode's end resets): steps
    over the wall time, and over this process's CPU time, which a busy machine inflates less."""
    actions = rng.integers(env.action_space.n, size=steps)
    wall, cpu = time.perf_counter(), time.process_time()
    for action in actions:
        _, _, terminated, truncated, _ = env.step(int(action))
        if terminated or truncated:
            env.reset()
    return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu)


def section_pipeline(chunks, steps):
    variants = {
        "ours (beast/atari_wrappers.py), OpenCV resize": (ours(), contextlib.nullcontext),
        "ours, NumpyAreaResize": (ours(), numpy_resize),
        "Gymnasium's AtariPreprocessing + FrameStackObservation(4)": (gymnasiums(),
                                                                      contextlib.nullcontext),
    }
    rng = np.random.default_rng(0)
    rates = {name: ([], []) for name in variants}
    for env, _ in variants.values():
        env.reset(seed=0)
    names = list(variants)
    for chunk in range(chunks):
        for name in names if chunk % 2 == 0 else names[::-1]:
            env, context = variants[name]
            with context():
                for rate, kept in zip(steps_per_second(env, steps, rng), rates[name]):
                    kept.append(rate)
    for env, _ in variants.values():
        env.close()
    rows = [f"| {name} | {spread(wall, 0)} | {spread(cpu, 0)} |"
            for name, (wall, cpu) in rates.items()]
    return "\n".join([
        f"3. The whole preprocessing on ALE/Pong-v5, random actions ({chunks} chunks of "
        f"{steps} steps each, alternating)", "",
        "| preprocessing | agent steps/s (wall) | agent steps per CPU second |", "|---|---|---|",
        *rows])


FIRE = 1  # Pong's and Breakout's action 1


def compare_frames(steps, seed):
    """Steps of ours and Gymnasium's on Pong, same seed and actions: counts of equal newest
    frames, mid-game and at a game's end, and of equal rewards."""
    mine, theirs = ours(), gymnasiums(stack=False)
    counts = types.SimpleNamespace(steps=0, equal=0, ends=0, ends_equal=0, rewards_equal=0)

    def reset(seed):
        frames, _ = mine.reset(seed=seed)
        theirs.reset(seed=seed)
        frame, *_ = theirs.step(FIRE)  # the FIRE that ours presses inside reset
        return frames[-1], frame

    a, b = reset(seed)
    assert np.array_equal(a, b), "the first frames differ"
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        action = int(rng.integers(mine.action_space.n))
        frames, reward, terminated, truncated, _ = mine.step(action)
        frame, their_reward, *_ = theirs.step(action)
        end = terminated or truncated
        same = bool(np.array_equal(frames[-1], frame))
        counts.steps += 1
        counts.equal += same
        counts.ends += end
        counts.ends_equal += same and end
        counts.rewards_equal += reward == their_reward
        if end:
            a, b = reset(None)
            assert np.array_equal(a, b), "a new game's first frames differ"
    mine.close()
    theirs.close()
    return counts


def lives_after_first_life_loss():
    """(ours with episodic_life, Gymnasium's with terminal_on_life_loss): Breakout's lives after
    the reset that follows the first lost life."""
    lives = []
    for env in (atari_wrappers.AtariPreprocessing(make_atari("breakout"), episodic_life=True),
                gymnasiums("breakout", terminal_on_life_loss=True, stack=False)):
        env.reset(seed=0)
        rng = np.random.default_rng(0)
        while True:
            _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
            if terminated or truncated:
                break
        env.reset()
        lives.append(env.unwrapped.ale.lives())
        env.close()
    return lives


def section_gymnasium(steps, seed=0):
    c = compare_frames(steps, seed)
    ours_lives, their_lives = lives_after_first_life_loss()
    return "\n".join([
        f"4. Ours against Gymnasium's AtariPreprocessing on ALE/Pong-v5, seed {seed}, {steps} "
        "random actions", "",
        "| | steps | newest frame equal | reward equal |", "|---|---|---|---|",
        f"| mid-game | {c.steps - c.ends:,} | {c.equal - c.ends_equal:,} | |",
        f"| a game's last step | {c.ends:,} | {c.ends_equal:,} | |",
        f"| all | {c.steps:,} | {c.equal:,} | {c.rewards_equal:,} |", "",
        f"Breakout, lives after the reset that follows the first lost life: ours (episodic_life) "
        f"{ours_lives}, Gymnasium's (terminal_on_life_loss) {their_lives}."])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Fewer blocks, chunks and steps.")
    args = parser.parse_args(argv)
    blocks, calls, chunks, steps, compare, pong_steps, game_steps = (
        (10, 200, 4, 300, 2000, 500, 200) if args.quick
        else (40, 500, 10, 1000, 6000, 6000, 2000))
    cpu, _ = machine.this_cpu()
    import cv2  # only for its version: beast/atari_wrappers.py is what calls it

    print(f"# The Atari screen\n\nCPU: {cpu}, {machine.cores()} cores; OpenCV {cv2.__version__}, "
          f"NumPy {np.__version__}, Gymnasium {gymnasium.__version__}, "
          f"ale-py {ale_py.__version__}\n")
    screens = [screen.copy() for screen in pong_screens(64)]
    for section in (section_per_call(screens, blocks, calls),
                    section_outputs(pong_steps, game_steps, random_images=512),
                    section_pipeline(chunks, steps), section_gymnasium(compare)):
        print(section + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
