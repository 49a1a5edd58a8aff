"""Videos of games (beast/video.py): the recorder on real environments, the flags end to end
for both variants, and bad input."""

import csv
import os
import subprocess
import sys

import imageio.v2 as imageio
import numpy as np
import pytest

import monobeast
from beast import envs, training, video
from bench import null_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_flags(*args):
    return training.parse_flags(monobeast.make_parser(), list(args))


def read_video(path):
    """(uint8 [N, H, W, 3] frames, fps) of an MP4, decoded by imageio."""
    reader = imageio.get_reader(path, format="FFMPEG")
    try:
        return np.stack(list(reader.iter_data())), reader.get_meta_data()["fps"]
    finally:
        reader.close()


def run(variant, tmp_path, *args, check=True):
    cmd = [sys.executable, "-m", variant, "--savedir", str(tmp_path), "--no_progress",
           *map(str, args)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


# (env, size of a video frame, fps): CartPole's own drawing, the Atari screen in colour at
# the agent's 15 steps a second, MinAtar's 10x10 palette scaled up 16 times.
RENDERS = [("CartPole-v1", (400, 600), 50), ("ALE/Pong-v5", (210, 160), 15),
           ("MinAtar/Breakout-v1", (160, 160), 30)]


@pytest.mark.parametrize("env_id, size, fps", RENDERS, ids=[r[0] for r in RENDERS])
def test_recorded_game_decodes_with_one_frame_per_step(tmp_path, env_id, size, fps):
    """A game of at most 40 steps (a longer one is cut by close(), and written as far as it
    got): one frame after the reset and one per step, the environment's own RGB screen."""
    flags = make_flags("--env", env_id)
    path = str(tmp_path / "game.mp4")
    env = envs.RolloutAdapter(video.create_env(flags, [path]), seed=3)
    rng = np.random.default_rng(0)
    steps = 0
    try:
        env.initial()
        while steps < 40:
            steps += 1
            if env.step(rng.integers(env.num_actions))["game_over"]:
                break
    finally:
        env.close()
    assert os.listdir(tmp_path) == ["game.mp4"]  # no partial file left behind
    frames, file_fps = read_video(path)
    assert frames.shape == (steps + 1, *size, 3)
    assert file_fps == fps
    # The first frame is the environment's render of the same reset (H.264 is lossy).
    reference = envs.create_env(flags, render_mode="rgb_array")
    reference.reset(seed=3)
    expected = video.video_frame(reference.render())
    reference.close()
    assert np.abs(frames[0].astype(float) - expected).mean() < 8
    assert np.abs(frames[0].astype(float) - frames[-1]).mean() > 0.1  # the game moved
    if env_id != "MinAtar/Breakout-v1":  # colour, not the grey input of the agent
        assert np.abs(frames[0][..., 0].astype(float) - frames[0][..., 1]).max() > 30


@pytest.mark.slow
def test_gif_of_a_recorded_game(tmp_path):
    """python -m beast.video gif: every second frame of the MP4, half the size, looping."""
    flags = make_flags("--env", "CartPole-v1")
    mp4, gif = str(tmp_path / "game.mp4"), str(tmp_path / "game.gif")
    env = envs.RolloutAdapter(video.create_env(flags, [mp4]), seed=1)
    try:
        env.initial()
        for _ in range(20):
            env.step(0)
    finally:
        env.close()
    frames, _ = read_video(mp4)
    result = subprocess.run([sys.executable, "-m", "beast.video", "gif", mp4, gif], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    kept = (len(frames) + 1) // 2
    assert f"{kept} frames" in result.stdout
    # The GIF writer merges identical consecutive frames (a still screen), adding up their
    # display times: at most one frame in the file per frame kept.
    gif_frames = imageio.mimread(gif)
    assert 0 < len(gif_frames) <= kept
    assert gif_frames[0].shape[:2] == (200, 300)


def test_training_envs_do_not_render():
    flags = make_flags("--env", "ALE/Pong-v5")
    assert envs.create_env(flags).unwrapped.render_mode is None
    assert video.create_env(flags).unwrapped.render_mode is None


def test_video_frame_makes_any_rgb_image_encodable():
    small = video.video_frame(np.ones((10, 10, 3)) * 0.5)  # MinAtar: float in [0, 1]
    assert small.shape == (160, 160, 3) and small.dtype == np.uint8 and small.max() == 128
    odd = video.video_frame(np.full((201, 301, 4), 7, np.uint8))  # alpha dropped, even sizes
    assert odd.shape == (202, 302, 3) and odd[:201, :301].min() == 7 and odd[201].max() == 0
    for bad in (None, np.zeros((8, 8)), np.zeros((8, 8, 2))):
        with pytest.raises(ValueError, match="RGB image"):
            video.video_frame(bad)


@pytest.mark.slow
def test_train_and_test_videos_for_both_variants(tmp_path):
    """Training records one evaluation game every N steps, named by step; --mode test
    records every game, with MonoBeast and PolyBeast alike."""
    run("monobeast", tmp_path, "--env", "CartPole-v1", "--xpid", "cp", "--num_actors", 1,
        "--total_steps", 2560, "--log_interval_steps", 1280, "--eval_video_interval_steps", 1280)
    videos = tmp_path / "cp" / "videos"
    assert sorted(os.listdir(videos)) == ["eval-step-000001280.mp4", "eval-step-000002560.mp4"]
    with open(tmp_path / "cp" / "logs.csv") as f:
        returns = {int(r["step"]): float(r["video_episode_return"]) for r in csv.DictReader(f)
                   if r["video_episode_return"]}
    for step, episode_return in returns.items():  # CartPole: one reward per step
        frames, _ = read_video(videos / f"eval-step-{step:09d}.mp4")
        assert frames.shape == (int(episode_return) + 1, 400, 600, 3)
    for variant, episodes in (("monobeast", 2), ("polybeast", 3)):
        result = run(variant, tmp_path, "--mode", "test", "--xpid", "cp", "--record_video",
                     "--test_episodes", episodes)
        assert "Videos of the episodes" in result.stdout
        for i in range(episodes):
            frames, _ = read_video(videos / f"test-step-000002560-episode-{i:02d}.mp4")
            assert frames.shape[0] >= 9 and frames.shape[1:] == (400, 600, 3)


@pytest.mark.slow
def test_an_environment_without_rgb_frames_is_refused_before_training(tmp_path):
    result = run("monobeast", tmp_path, "--env", null_env.ENV_ID, "--xpid", "null",
                 "--eval_video_interval_steps", 1000, check=False)
    assert result.returncode == 2
    assert "--eval_video_interval_steps needs the environment's RGB frames" in result.stderr
    assert "Null-v0 cannot render them" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "null").exists()
    test_flags = make_flags("--env", null_env.ENV_ID, "--mode", "test", "--record_video")
    [problem] = video.render_problems(test_flags)
    assert problem.startswith("--record_video needs") and "Null-v0" in problem


@pytest.mark.slow
def test_bad_video_flags_are_reported_together(tmp_path):
    """--record_video is for --mode test; a missing encoder names the package to install."""
    code = ("import sys; sys.modules['imageio_ffmpeg'] = None; import monobeast; "
            f"sys.exit(monobeast.main(['--savedir', {str(tmp_path)!r}, '--record_video', "
            "'--eval_video_interval_steps', '-1']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    for text in ("--record_video records the games of --mode test",
                 "--eval_video_interval_steps must be an integer >= 0 (got -1)",
                 "pip install imageio-ffmpeg"):
        assert text in result.stderr
    assert "Traceback" not in result.stderr


def test_whole_mp4_tells_a_finished_video_from_a_cut_one(tmp_path):
    path = str(tmp_path / "game.mp4")
    writer = video.VideoWriter(path, fps=30)
    for i in range(10):
        writer.append(np.full((32, 32, 3), 20 * i, np.uint8))
    assert writer.close() == path and video.whole_mp4(path)
    data = open(path, "rb").read()
    for name, cut in (("half", data[: len(data) // 2]), ("no_index", data[:-8]),
                      ("empty", b""), ("junk", b"\xff" * 100)):
        (tmp_path / name).write_bytes(cut)
        assert not video.whole_mp4(str(tmp_path / name)), name
    assert not video.whole_mp4(str(tmp_path / "missing"))


def test_a_video_on_a_full_disk_is_one_error_and_no_file(small_disk):
    """Whether ffmpeg stops at a frame or cannot finish the file, the writer raises
    VideoError saying the disk is full, and neither the video nor its .part file stays."""
    videos = os.path.join(small_disk.path, "videos")
    os.mkdir(videos)
    small_disk.fill()
    rng = np.random.default_rng(0)
    writer = video.VideoWriter(os.path.join(videos, "game.mp4"), fps=30)
    with pytest.raises(video.VideoError,
                       match=r"cannot write the video .*game.mp4: .*disk is full"):
        for _ in range(200):  # noise: it does not compress
            writer.append(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8))
        writer.close()
    assert os.listdir(videos) == []


@pytest.mark.slow
def test_a_video_that_cannot_be_written_does_not_end_training(tmp_path):
    """Evaluation videos that fail (here: a file where the videos folder should be) are a
    warning: training and the evaluations go on. --mode test ends with one message."""
    (tmp_path / "cp").mkdir()
    (tmp_path / "cp" / "videos").write_text("not a folder")
    result = run("monobeast", tmp_path, "--env", "CartPole-v1", "--xpid", "cp",
                 "--num_actors", 1, "--total_steps", 2560, "--log_interval_steps", 1280,
                 "--eval_video_interval_steps", 1280, "--eval_interval_steps", 1280,
                 "--eval_episodes", 1)
    assert result.stderr.count("warning: cannot write the video") == 2, result.stderr
    assert "Traceback" not in result.stderr
    with open(tmp_path / "cp" / "logs.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = [int(r["step"]) for r in rows if r.get("eval_mean_episode_return")]
    assert evaluated == [1280, 2560]
    assert not any(r.get("video_episode_return") for r in rows)
    test = run("monobeast", tmp_path, "--mode", "test", "--xpid", "cp", "--record_video",
               check=False)
    assert test.returncode == 2 and "Traceback" not in test.stderr
    assert test.stderr.startswith("error: cannot write the video"), test.stderr
