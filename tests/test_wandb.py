"""Weights & Biases tracking (beast/runlog.py WandbTracker), in W&B's offline mode: no
network, no account. What W&B wrote is read back from its run files (run-ID.wandb)."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest
from wandb.proto import wandb_internal_pb2

from beast import runlog

pytestmark = pytest.mark.slow  # every test here runs a training or a fresh interpreter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOG_BLOCK = 32768  # the .wandb file is a LevelDB-style log of Record protos in 32 KiB blocks
FULL, LAST = 1, 4  # chunk types that end a record (FIRST = 2 and MIDDLE = 3 continue it)


def read_wandb_records(path):
    """The Record protos of an offline run file, in order.

    Layout: a 7-byte header (":W&B", a magic number, a version), then chunks of
    [crc32c (4 bytes), length (2, little-endian), type (1), data]; a chunk never crosses
    a block boundary, and a block's tail shorter than a chunk header is padding.
    """
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = LOG_BLOCK - pos % LOG_BLOCK
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def offline_run(run_dir):
    """(run id, config {key: value}, history rows [{key: value}], the run's folder) of one
    offline run folder of W&B."""
    [path] = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run_id, config, history = None, {}, []
    for record in read_wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            # Newer versions of W&B write keys as nested_key (a video: eval_video/path, ...).
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return run_id, config, history, run_dir


def train(tmp_path, env, total_steps):
    cmd = [sys.executable, "-m", "monobeast", "--savedir", str(tmp_path / "runs"), "--xpid",
           "cp", "--env", "CartPole-v1", "--num_actors", "1", "--no_progress",
           "--total_steps", str(total_steps), "--log_interval_steps", "1280",
           "--eval_video_interval_steps", "2560", "--wandb_project", "beast-test"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def wandb_env(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    env.pop("WANDB_API_KEY", None)
    (tmp_path / "wandb").mkdir()
    return env


def test_a_run_and_its_resume_are_one_wandb_run(tmp_path):
    """The rows of logs.csv, the flags, the videos; a resume keeps the W&B run id."""
    env = wandb_env(tmp_path)
    train(tmp_path, env, 2560)
    train(tmp_path, env, 5120)  # the resume: the same --xpid, more steps
    with open(tmp_path / "runs" / "cp" / "wandb_id") as f:
        run_id = f.read().strip()
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*")))
    assert len(runs) == 2, runs
    (first_id, first_config, first, _), (second_id, second_config, second, second_dir) = (
        offline_run(run) for run in runs)
    assert first_id == second_id == run_id
    assert first_config["env"] == "CartPole-v1" and first_config["total_steps"] == 2560
    assert second_config["total_steps"] == 5120
    logged = [{k: v for k, v in row.items() if k != "_time" and not math.isnan(v)}
              for row in runlog.read_logs(tmp_path / "runs" / "cp" / "logs.csv")]
    rows = [{k: v for k, v in row.items() if not k.startswith(("_", "eval_video"))}
            for row in first + second]
    assert rows == logged
    assert [row["step"] for row in first] == [1280, 2560, 2560]
    videos = [row for row in second if "eval_video/path" in row]
    assert [row["step"] for row in videos] == [5120]
    assert videos[0]["eval_video/_type"] == "video-file"
    assert os.path.getsize(os.path.join(second_dir, "files", videos[0]["eval_video/path"])) > 0


def test_nothing_of_wandb_is_imported_without_the_flag(tmp_path):
    code = ("import sys, monobeast; "
            f"rc = monobeast.main(['--savedir', {str(tmp_path)!r}, '--env', 'CartPole-v1', "
            "'--num_actors', '1', '--total_steps', '1280', '--no_progress']); "
            "assert rc == 0, rc; assert 'wandb' not in sys.modules, 'wandb was imported'; "
            "print('not imported')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "not imported" in result.stdout, result.stderr[-4000:]


def test_without_wandb_installed_the_flag_names_the_package(tmp_path):
    code = ("import sys; sys.modules['wandb'] = None; import monobeast; "
            f"sys.exit(monobeast.main(['--savedir', {str(tmp_path)!r}, "
            "'--wandb_project', 'p', '--total_steps', '1280']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert "--wandb_project needs the Weights & Biases package: pip install wandb" in result.stderr
    assert "Traceback" not in result.stderr and not os.listdir(tmp_path)
