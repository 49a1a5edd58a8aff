"""Videos of whole games: the environment's own RGB screen, one MP4 per game.

`--mode test --record_video` records every test game and `--eval_video_interval_steps N` one
offline-evaluation game every N steps, into the run's folder (savedir/xpid/videos/):

    test-step-000500000-episode-03.mp4   the checkpoint's step, then the game
    eval-step-000100000.mp4              the step of the weights that played

The frames are what the environment renders with Gymnasium's render_mode="rgb_array" (the
Atari screen in colour, CartPole's drawing, MinAtar's palette), not the preprocessed
observation the agent sees. Only the environments made here render: training environments
never pay for it. Encoding is imageio's ffmpeg plugin (pip install imageio imageio-ffmpeg),
imported only when a video is written. A video appears under its name once it is complete.

For a README or a web page, `python -m beast.video gif GAME.mp4 GAME.gif` makes a small
looping GIF of a recorded game (every --every'th frame, scaled by --scale).
"""

import os
import shutil

import gymnasium
import numpy as np

from beast import envs

RENDER_MODE = "rgb_array"
DEFAULT_FPS = 30  # for environments that do not say (metadata["render_fps"])
# Frames smaller than this many pixels on their longer side (MinAtar's 10x10) are scaled up by
# a whole factor, so that players show cells rather than a blur of a few pixels.
MIN_VIDEO_SIZE = 160


def paths_for_test(videos_dir, step, num_episodes):
    """The paths of --mode test's videos: one per game, named by the checkpoint's step."""
    return [os.path.join(videos_dir, f"test-step-{int(step):09d}-episode-{i:02d}.mp4")
            for i in range(num_episodes)]


def path_for_eval(videos_dir, step):
    """The path of the video of the offline evaluation at `step`."""
    return os.path.join(videos_dir, f"eval-step-{int(step):09d}.mp4")


def wanted(flags):
    """Whether this start of the run records videos."""
    if flags.mode == "test":
        return flags.record_video
    return flags.eval_video_interval_steps > 0


def render_problems(flags):
    """[] when no video is asked for or the environment renders RGB frames; else one problem
    (for validate_flags) that names the environment. Makes, resets and renders one
    environment, so it is called once, before any work starts."""
    if not wanted(flags):
        return []
    flag = "--record_video" if flags.mode == "test" else "--eval_video_interval_steps"
    try:
        env = _rendering_env(flags)
        try:
            env.reset(seed=0)
            video_frame(env.render())
        finally:
            env.close()
    except Exception as e:  # whatever the environment's code raises, the user gets one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [f"{flag} needs the environment's RGB frames (render_mode={RENDER_MODE!r}), and "
                f"{flags.env} cannot render them: {reason}"]
    return []


def create_env(flags, paths=()):
    """envs.create_env(flags); with `paths`, an environment that renders and writes its next
    len(paths) games to them (EpisodeRecorder), else one that never renders."""
    if not paths:
        return envs.create_env(flags)
    return EpisodeRecorder(_rendering_env(flags), paths)


def _rendering_env(flags):
    # pygame (CartPole's drawing) draws rgb_array frames off-screen, but SDL still looks for a
    # display and prints an error on a machine without one. A driver the user chose wins.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    return envs.create_env(flags, render_mode=RENDER_MODE)


def video_frame(frame):
    """One frame of render() as uint8 [H', W', 3] that H.264 (yuv420p) can encode.

    frame: [H, W, 3] or [H, W, 4] (alpha dropped); uint8, or float in [0, 1] (MinAtar) or
    [0, 255]. Small frames are scaled up by a whole factor (nearest pixel: cells stay sharp);
    an odd height or width gets one black row or column, as yuv420p needs even sizes.
    Raises ValueError for anything that is not an RGB image (None: the env renders nothing).
    """
    frame = np.asarray(frame)
    if frame.ndim != 3 or frame.shape[2] not in (3, 4) or frame.dtype == object:
        raise ValueError(f"render() returned {type(frame).__name__} of shape {frame.shape} "
                         "rather than an RGB image [H, W, 3]")
    frame = frame[:, :, :3]
    if frame.dtype != np.uint8:
        frame = frame.astype(np.float32)
        scale = 255.0 if frame.size and frame.max() <= 1.0 else 1.0
        frame = (np.clip(frame * scale, 0.0, 255.0) + 0.5).astype(np.uint8)
    factor = max(1, MIN_VIDEO_SIZE // max(frame.shape[:2]))
    if factor > 1:
        frame = frame.repeat(factor, axis=0).repeat(factor, axis=1)
    pad_rows, pad_cols = frame.shape[0] % 2, frame.shape[1] % 2
    if pad_rows or pad_cols:
        frame = np.pad(frame, ((0, pad_rows), (0, pad_cols), (0, 0)))
    return np.ascontiguousarray(frame)


class VideoError(OSError):
    """A video could not be written (a full disk, ffmpeg stopped); its partial file is gone."""


class VideoWriter:
    """One MP4, written frame by frame (never held in memory: a game can last 27000 steps).

    The file is written as NAME.part.mp4 and renamed to `path` by close(), so a video that
    exists is whole; a crash leaves only the .part file. A write that fails raises
    VideoError and removes the partial file.
    """

    def __init__(self, path, fps):
        # Imported here: runs that record nothing need neither imageio nor ffmpeg.
        import imageio.v2 as imageio

        self.path = path
        self.partial_path = f"{os.path.splitext(path)[0]}.part.mp4"
        self.frames = 0
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            # macro_block_size=1: video_frame already makes the sizes even, and imageio's
            # default (16) would rescale the screen.
            self._writer = imageio.get_writer(
                self.partial_path, format="FFMPEG", mode="I", fps=fps, codec="libx264",
                pixelformat="yuv420p", macro_block_size=1, ffmpeg_log_level="error")
        except OSError as e:
            raise self._failed(e.strerror or e) from e

    def append(self, frame):
        try:
            self._writer.append_data(video_frame(frame))
        except OSError as e:  # imageio's, when ffmpeg has stopped: its message is above
            raise self._failed(e.strerror) from e
        self.frames += 1

    def close(self):
        """Finishes the file; returns its path."""
        try:
            self._writer.close()
        except OSError as e:
            raise self._failed(e.strerror) from e
        # ffmpeg reports a failed finish (no room for the index at the end) on its stderr
        # only, and imageio does not look at its exit code: the file itself tells.
        if not whole_mp4(self.partial_path):
            raise self._failed(None)
        os.replace(self.partial_path, self.path)
        return self.path

    def _failed(self, reason):
        """Stops ffmpeg, removes the partial file; the VideoError to raise."""
        writer, self._writer = getattr(self, "_writer", None), None
        if writer is not None:
            try:
                writer.close()
            except Exception:
                pass  # ffmpeg has failed already; its message says why
        if os.path.exists(self.partial_path):
            os.remove(self.partial_path)
        directory = os.path.dirname(os.path.abspath(self.path))
        if reason is None:
            reason = "ffmpeg stopped (its message is above)"
        if os.path.isdir(directory) and shutil.disk_usage(directory).free == 0:
            reason += "; the disk is full"
        return VideoError(f"cannot write the video {self.path}: {reason}")


def whole_mp4(path):
    """Whether the MP4 at path is complete: its top-level boxes (4-byte big-endian size,
    4-byte type) tile the file exactly, and one of them is the index ("moov"), which
    ffmpeg writes last."""
    try:
        size = os.path.getsize(path)
        boxes, offset = set(), 0
        with open(path, "rb") as f:
            while offset < size:
                f.seek(offset)
                header = f.read(16)
                if len(header) < 8:
                    return False
                length, kind = int.from_bytes(header[:4], "big"), header[4:8]
                if length == 1 and len(header) == 16:  # a 64-bit size follows
                    length = int.from_bytes(header[8:16], "big")
                if length < 8:  # 0 ("to the end") is not what ffmpeg writes
                    return False
                boxes.add(kind)
                offset += length
    except OSError:
        return False
    return offset == size and b"moov" in boxes


class EpisodeRecorder(gymnasium.Wrapper):
    """Writes the RGB screen of the next len(paths) games to `paths`, one MP4 each.

    A game is the real one: with end-of-life episodes (info["game_over"] False at a lost
    life) the video goes on across the lives. Its frames are the screen after reset() and
    after every step(). A game cut short by close() is written as far as it got. Once every
    path is used, nothing is rendered any more. `written` lists the finished videos' paths.
    """

    def __init__(self, env, paths):
        super().__init__(env)
        self.paths = list(paths)
        self.written = []
        self.fps = (env.metadata or {}).get("render_fps") or DEFAULT_FPS
        self._writer = None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        if self._writer is None and self.paths:
            self._writer = VideoWriter(self.paths.pop(0), self.fps)
        if self._writer is not None:  # a new game, or the same one after a lost life
            self._record()
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._writer is not None:
            self._record()
            if info.get("game_over", terminated or truncated):
                self._finish()
        return obs, reward, terminated, truncated, info

    def _record(self):
        try:
            self._writer.append(self.env.render())
        except VideoError:
            self._writer = None  # it has stopped and removed its partial file
            raise

    def _finish(self):
        writer, self._writer = self._writer, None
        self.written.append(writer.close())

    def close(self):
        try:
            if self._writer is not None:
                self._finish()
        finally:
            super().close()


def to_gif(mp4_path, gif_path, every=2, scale=0.5, max_frames=600):
    """Writes a looping GIF of the MP4 at mp4_path: every `every`-th frame (at the video's fps
    divided by `every`, so it plays at the game's speed), each scaled by `scale` (nearest
    pixel: no new colours), at most max_frames frames. Returns the number of frames."""
    import imageio.v2 as imageio

    reader = imageio.get_reader(mp4_path, format="FFMPEG")
    try:
        fps = reader.get_meta_data()["fps"]
        frames = []
        for i, frame in enumerate(reader.iter_data()):
            if i % every == 0 and len(frames) < max_frames:
                frames.append(_scaled(frame, scale))
    finally:
        reader.close()
    if not frames:
        raise ValueError(f"{mp4_path} holds no frames")
    # GIF delays are hundredths of a second; imageio's pillow writer takes milliseconds.
    imageio.mimsave(gif_path, frames, format="GIF", duration=1000.0 * every / fps, loop=0)
    return len(frames)


def _scaled(frame, scale):
    rows = np.linspace(0, frame.shape[0] - 1, max(1, round(frame.shape[0] * scale))).round()
    cols = np.linspace(0, frame.shape[1] - 1, max(1, round(frame.shape[1] * scale))).round()
    return frame[rows.astype(int)][:, cols.astype(int)]


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m beast.video",
                                     description="Make a looping GIF of a recorded game.")
    sub = parser.add_subparsers(dest="command", required=True)
    gif = sub.add_parser("gif", help="MP4 -> GIF")
    gif.add_argument("mp4",
                     help="A video written by --record_video or --eval_video_interval_steps.")
    gif.add_argument("gif", help="The GIF to write.")
    gif.add_argument("--every", type=int, default=2, help="Keep every N-th frame.")
    gif.add_argument("--scale", type=float, default=0.5, help="Scale each frame by this.")
    gif.add_argument("--max_frames", type=int, default=600, help="Stop after this many frames.")
    args = parser.parse_args(argv)
    if args.every < 1 or not 0 < args.scale <= 4 or args.max_frames < 1:
        parser.error("--every and --max_frames must be at least 1, --scale in (0, 4]")
    count = to_gif(args.mp4, args.gif, args.every, args.scale, args.max_frames)
    print(f"{args.gif}: {count} frames")


if __name__ == "__main__":
    main()
