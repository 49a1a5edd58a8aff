"""What one environment step costs, by what the stepping thread does between its batches.

    python -m bench.stepcost                       # ALE/Pong-v5, 4 envs, 15 s a pattern
    python -m bench.stepcost --env MinAtar/Breakout-v1 --rounds 3

A MonoBeast actor steps its environments and then runs the acting forward pass itself; a
PolyBeast env server steps them and then waits for its round trip to inference, while the
core runs something else or idles. The same environment code can cost more per step in the
second pattern, because what ran in between (or the idle core) left the caches and the
branch predictors cold. This measures it: a vector env of --num_envs (the path of both
variants, beast/vector_envs.py) is stepped with random actions in one thread, in turns of
these patterns, and only the stepping's CPU time is counted (CLOCK_THREAD_CPUTIME, so
time spent waiting or preempted is not):

  tight     step, step, ...: the floor.
  forward   step, then the acting forward pass on the batch in the same thread, as a
            MonoBeast actor does.
  sleep     step, then sleep --wait_ms with the core otherwise idle.
  shared    step, then sleep --wait_ms while another process pinned to the same core runs
            forward passes without pause, as inference or the learner does on a machine
            with fewer cores than threads. This process is pinned there too.

Prints core-microseconds per environment step for each pattern and its ratio to tight.
Timings are noisy: the patterns run in turns, --rounds times, and the medians are reported.
"""

import argparse
import multiprocessing
import os
import statistics
import time

import numpy as np
import torch

from bench import ceilings
from beast import envs
from beast import machine
from beast import vector_envs

PATTERNS = ("tight", "forward", "sleep", "shared")


def make_parser():
    parser = argparse.ArgumentParser(prog="python -m bench.stepcost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="ALE/Pong-v5", help="Gymnasium id to step.")
    parser.add_argument("--num_envs", type=int, default=4,
                        help="Environments stepped together (a MonoBeast actor's and a "
                             "PolyBeast stream's default on 2 cores is 4).")
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="Wall seconds of each pattern in each round.")
    parser.add_argument("--rounds", type=int, default=2,
                        help="Turns through all patterns; medians over them are printed.")
    parser.add_argument("--wait_ms", type=float, default=2.0,
                        help="The sleep after each batch in the sleep and shared patterns "
                             "(a Pong round trip on 2 cores is a few ms).")
    parser.add_argument("--core", type=int, default=0,
                        help="The core the shared pattern pins both processes to.")
    return parser


def acting_forward(env_id, num_envs):
    """A function that runs the acting forward pass of env_id's default network on a batch of
    num_envs random observations, with one intra-op thread."""
    info = envs.env_info(argparse.Namespace(env=env_id, episodic_life=False,
                                            env_backend="gymnasium"))
    net = ceilings.ATARI_NET if info["kind"] == "atari" else ceilings.NetSpec(
        "mlp", 128, info["observation_shape"], info["num_actions"])
    flags, net_info = ceilings.net_flags(net._replace(
        observation_shape=tuple(info["observation_shape"]), num_actions=info["num_actions"]))
    model = ceilings.build_net(flags, net_info)
    batch = ceilings.random_rollout(flags, net_info, 1, num_envs)
    inputs = {k: batch[k] for k in ("frame", "reward", "done", "last_action")}
    state = model.initial_state(num_envs)

    def forward():
        with torch.no_grad():
            model(inputs, state)
    return forward


def _busy(env_id, num_envs, core, ready):
    """The shared pattern's neighbour: forward passes on `core` until killed."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    forward = acting_forward(env_id, num_envs)
    ready.set()
    while True:
        forward()


def run_pattern(pattern, venv, actions, forward, flags):
    """Core-microseconds per environment step of venv.step under `pattern`."""
    neighbour = None
    if pattern == "shared":
        ready = multiprocessing.get_context("fork").Event()
        neighbour = multiprocessing.get_context("fork").Process(
            target=_busy, args=(flags.env, flags.num_envs, flags.core, ready), daemon=True)
        neighbour.start()
        ready.wait()
        os.sched_setaffinity(0, {flags.core})
    try:
        stepping, steps, i = 0.0, 0, 0
        end = time.monotonic() + flags.seconds
        while time.monotonic() < end:
            started = time.thread_time()
            venv.step(actions[i % len(actions)])
            stepping += time.thread_time() - started
            steps += flags.num_envs
            i += 1
            if pattern == "forward":
                forward()
            elif pattern in ("sleep", "shared"):
                time.sleep(flags.wait_ms / 1000)
        return 1e6 * stepping / steps
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.join()
            os.sched_setaffinity(0, range(os.cpu_count()))


def main(argv=None):
    flags = make_parser().parse_args(argv)
    torch.set_num_threads(1)
    env_flags = argparse.Namespace(env=flags.env, episodic_life=False, env_backend="gymnasium")
    venv = vector_envs.create_vector_env(env_flags, flags.num_envs, seed=0)
    num_actions = envs.env_info(env_flags)["num_actions"]
    actions = np.random.default_rng(0).integers(0, num_actions, (4096, flags.num_envs))
    forward = acting_forward(flags.env, flags.num_envs)
    venv.initial()
    for i in range(100):  # first episodes, caches
        venv.step(actions[i])
    print(f"{flags.env}, {flags.num_envs} envs, {flags.seconds:g} s a pattern, "
          f"wait {flags.wait_ms:g} ms; CPU: {machine.this_cpu()[0]}", flush=True)
    costs = {pattern: [] for pattern in PATTERNS}
    for round_ in range(flags.rounds):
        for pattern in PATTERNS:
            costs[pattern].append(run_pattern(pattern, venv, actions, forward, flags))
            print(f"  round {round_ + 1} {pattern:8s} {costs[pattern][-1]:6.0f} core-us/step",
                  flush=True)
    tight = statistics.median(costs["tight"])
    print("median core-us per environment step (and against tight):")
    for pattern in PATTERNS:
        cost = statistics.median(costs[pattern])
        print(f"  {pattern:8s} {cost:6.0f}  {cost / tight:4.2f}x")
    venv.close()


if __name__ == "__main__":
    main()
