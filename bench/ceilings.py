"""Ceilings: each piece of a training step measured alone, in this process.

  env_sps          a vector env of VECTOR_ENVS (beast/vector_envs.py, the path of MonoBeast's
                   actors and PolyBeast's servers) with random actions, one process
  learner_ms       beast.learner.learn_step on a random [T+1, B] rollout
  inference_ms     the acting forward pass (no grad, T=1) on a batch of B environments

Every measurement is cached in a `Ceilings` object, so the compute bound of an
end-to-end configuration asks for what it needs and reuses what the ceiling
sections have already measured (or measures it then, with --only e2e).

Costs used for the bound are taken with one intra-op thread: one thread's wall
time is the number of core-seconds the work needs, whatever else runs on the
machine. (Spread over more threads the same work costs at least as many
core-seconds, so the bound stays an upper bound.)
"""

import collections
import contextlib
import importlib.util
import statistics
import time

import numpy as np
import torch

import monobeast
from beast import envpool_backend
from beast import envs
from beast import flags as beast_flags
from beast import learner
from beast import models
from beast import rollout
from beast import vector_envs

# What a network needs to be built and fed: the observation, the actions and its width.
# channels: the ResNet's section widths (--channels), "16,32,32" unless a workload types others.
# kind: the environment kind whose defaults (loss flags, T, B) the learner takes (beast/flags.py
# ENV_DEFAULTS); None: "atari" for images, "vector" otherwise.
NetSpec = collections.namedtuple("NetSpec",
                                 "model hidden_size observation_shape num_actions channels kind",
                                 defaults=("16,32,32", None))

ATARI_NET = NetSpec("atari", 128, (4, 84, 84), 6)  # hidden_size: unused by the conv net
CARTPOLE_NET = NetSpec("mlp", beast_flags.ENV_DEFAULTS["vector"]["hidden_size"], (4,), 2)
NULL_NET = NetSpec("mlp", 8, (4,), 2)


def net_label(net):
    if net.model == "mlp":
        return f"MLP {net.hidden_size} (obs {net.observation_shape[0]}, {net.num_actions} actions)"
    shape = "x".join(map(str, net.observation_shape))
    name = {"atari": "Atari net", "resnet": f"ResNet {net.channels}"}.get(net.model, net.model)
    return f"{name} ({shape}, {net.num_actions} actions)"


def net_flags(net, precision="fp32"):
    """MonoBeast's flags for a network, with the repo's defaults for that kind of input.

    Returns (flags, info) as the learner would see them: T, B, learning rate,
    costs, etc. come from beast.flags ENV_DEFAULTS for net.kind.
    """
    is_image = len(net.observation_shape) == 3
    info = dict(
        observation_shape=tuple(net.observation_shape),
        observation_dtype=np.dtype(np.uint8 if is_image else np.float32),
        num_actions=net.num_actions,
        kind=net.kind or ("atari" if is_image else "vector"),
    )
    argv = ["--model", net.model, "--hidden_size", str(net.hidden_size),
            "--channels", net.channels, "--precision", precision]
    flags = monobeast.make_parser().parse_args(argv)
    beast_flags.apply_env_defaults(flags, info["kind"])
    beast_flags.resolve_precisions(flags, "cpu")
    flags.total_steps = 10**12  # keeps the learning rate schedule away from zero
    return flags, info


def build_net(flags, info):
    return models.create_model(flags, info["observation_shape"], info["num_actions"])


def random_rollout(flags, info, length, batch_size, seed=0):
    """A rollout dict of random tensors [length, batch_size, ...] in MonoBeast's buffer layout."""
    generator = torch.Generator().manual_seed(seed)
    env_fields = rollout.core_env_fields(info["observation_shape"], info["observation_dtype"])
    schema = rollout.Schema.of(env_fields, build_net(flags, info), info["num_actions"])
    batch = {}
    for key, field in schema.fields.items():
        size = (length, batch_size) + field.shape
        dtype = field.torch_dtype
        if dtype == torch.uint8:
            value = torch.randint(0, 256, size, dtype=dtype, generator=generator)
        elif dtype == torch.bool:
            value = torch.rand(size, generator=generator) < 0.01  # episode ends are rare
        elif dtype.is_floating_point:
            value = torch.randn(size, generator=generator).to(dtype)
        else:  # actions, last actions, episode steps
            value = torch.randint(0, info["num_actions"], size, dtype=dtype, generator=generator)
        batch[key] = value
    return batch


@contextlib.contextmanager
def torch_threads(num_threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def time_calls(fn, min_calls, budget_s, warmup=1, max_calls=20_000):
    """Calls fn `warmup` times untimed, then until it has been called at least
    min_calls times and budget_s seconds have passed. Returns the seconds of each timed call."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_calls:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if len(times) >= min_calls and t1 - start >= budget_s:
            break
    return times


def summary(values):
    """dict(median, min, max, n) of a list of numbers."""
    return dict(median=statistics.median(values), min=min(values), max=max(values), n=len(values))


class Ceilings:
    """Cached ceiling measurements. `budget` scales the time each one may take (quick: small)."""

    def __init__(self, quick, log=print):
        self.quick = quick
        self.log = log
        self._env = {}
        self._learner = {}
        self._inference = {}

    # -- environment stepping ----------------------------------------------------------------

    def env(self, env_id):
        """Random-action env steps per second through a vector env of VECTOR_ENVS, one process.

        Returns dict(median, min, max, n, core_us) over n chunks of equal duration
        (steps/s; core_us: CPU microseconds of this process per step).
        """
        if env_id not in self._env:
            seconds, chunks = (2.4, 3) if self.quick else (8.0, 4)
            self.log(f"env stepping: {env_id} ({seconds:g} s)")
            self._env[env_id] = _measure_env(env_id, seconds, chunks)
        return self._env[env_id]

    def envpool(self, env_id, num_envs, batch_size, num_threads):
        """EnvPool's own stepping (send/recv; async when batch_size < num_envs), random actions.

        Returns the same dict as env(), core_us counting all of EnvPool's threads; None when
        EnvPool is not installed.
        """
        key = (env_id, num_envs, batch_size, num_threads)
        if key not in self._env:
            if importlib.util.find_spec("envpool") is None:
                return None
            seconds, chunks = (2.4, 3) if self.quick else (8.0, 4)
            self.log(f"EnvPool stepping: {env_id}, {num_envs} envs, batch {batch_size}, "
                     f"{num_threads} thread(s) ({seconds:g} s)")
            self._env[key] = _measure_envpool(env_id, num_envs, batch_size, num_threads,
                                              seconds, chunks)
        return self._env[key]

    # -- learner step -----------------------------------------------------------------------

    def learner(self, net, precision="fp32", threads=1, unroll_length=None, batch_size=None):
        """Seconds per learn_step (dict(median, min, max, n)) plus T and B used.

        unroll_length / batch_size default to the repo's defaults for the net's input.
        """
        flags, _ = net_flags(net, precision)
        T = unroll_length or flags.unroll_length
        B = batch_size or flags.batch_size
        key = (net, precision, threads, T, B)
        if key not in self._learner:
            min_steps, budget_s = (3, 1.5) if self.quick else (5, 6.0)
            if net.model == "mlp":
                min_steps, budget_s = 20, budget_s / 2
            self.log(f"learner step: {net_label(net)} T={T} B={B} {precision} "
                     f"{threads} thread(s)")
            result = _measure_learner(net, precision, threads, T, B, min_steps, budget_s)
            self._learner[key] = dict(result, unroll_length=T, batch_size=B)
        return self._learner[key]

    # -- inference ----------------------------------------------------------------------------

    def inference(self, net, batch_size, threads=1):
        """Seconds per acting forward pass of batch_size envs (dict(median, min, max, n))."""
        key = (net, batch_size, threads)
        if key not in self._inference:
            budget_s = 0.5 if self.quick else 2.0
            self.log(f"inference: {net_label(net)} batch {batch_size}, {threads} thread(s)")
            self._inference[key] = _measure_inference(net, batch_size, threads, budget_s)
        return self._inference[key]


# Environments in the vector env that env_sps steps: a few, as an actor or a server stream
# holds, so that the per-step cost includes the vector env's own (gathering N rows).
VECTOR_ENVS = 8


def _measure_env(env_id, seconds, chunks, check_every=8):
    flags = beast_flags.common_parser().parse_args(["--env", env_id, "--no-episodic_life"])
    env = vector_envs.create_vector_env(flags, VECTOR_ENVS, seed=0)
    num_actions = envs.env_info(flags)["num_actions"]
    actions = np.random.default_rng(0).integers(0, num_actions, (512, VECTOR_ENVS))
    try:
        env.initial()
        for i in range(50):  # warm-up: first episodes, caches
            env.step(actions[i])
        rates = []
        n = 0
        cpu_start = time.process_time()
        for _ in range(chunks):
            steps = 0
            start = time.perf_counter()
            deadline = start + seconds / chunks
            while True:
                for _ in range(check_every):
                    env.step(actions[n & 511])
                    n += 1
                steps += check_every * VECTOR_ENVS
                now = time.perf_counter()
                if now >= deadline:
                    break
            rates.append(steps / (now - start))
        core_us = (time.process_time() - cpu_start) * 1e6 / (n * VECTOR_ENVS)
    finally:
        env.close()
    return dict(summary(rates), core_us=core_us)


def _measure_envpool(env_id, num_envs, batch_size, num_threads, seconds, chunks):
    flags = beast_flags.common_parser().parse_args(
        ["--env", env_id, "--no-episodic_life", "--env_backend", "envpool"])
    pool = envpool_backend.create_envpool(flags, num_envs, batch_size=batch_size,
                                          num_threads=num_threads)
    rng = np.random.default_rng(0)
    num_actions = int(pool.action_space.n)
    try:
        pool.async_reset()
        for _ in range(50):  # warm-up
            info = pool.recv()[-1]
            pool.send(rng.integers(0, num_actions, len(info["env_id"])), info["env_id"])
        rates = []
        steps_all = 0
        cpu_start = time.process_time()  # the process's CPU time: EnvPool's threads included
        for _ in range(chunks):
            steps = 0
            start = time.perf_counter()
            deadline = start + seconds / chunks
            while time.perf_counter() < deadline:
                info = pool.recv()[-1]
                ids = info["env_id"]
                pool.send(rng.integers(0, num_actions, len(ids)), ids)
                steps += len(ids)
            rates.append(steps / (time.perf_counter() - start))
            steps_all += steps
        core_us = (time.process_time() - cpu_start) * 1e6 / steps_all
    finally:
        pool.close()
    return dict(summary(rates), core_us=core_us)


def learner_step(net, precision, unroll_length, batch_size, compile_torso=False):
    """A function that makes one learner step (learn_step, then the schedule) of `net` on one
    fixed random rollout of [unroll_length + 1, batch_size], in the learner's layout; with
    compile_torso, the torso under torch.compile (bench.learner_ops)."""
    flags, info = net_flags(net, precision)
    flags.unroll_length, flags.batch_size = unroll_length, batch_size
    torch.manual_seed(0)
    model = models.to_learning_layout(build_net(flags, info))
    if compile_torso:
        model.torso = torch.compile(model.torso)
    optimizer, scheduler = learner.create_optimizer(flags, model)
    batch = random_rollout(flags, info, unroll_length + 1, batch_size)
    state = model.initial_state(batch_size)

    def step():
        learner.learn_step(flags, model, optimizer, batch, state)
        scheduler.step()

    return step


def _measure_learner(net, precision, threads, unroll_length, batch_size, min_steps, budget_s):
    with torch_threads(threads):
        step = learner_step(net, precision, unroll_length, batch_size)
        # Two untimed steps: the first one allocates and (bf16) picks oneDNN kernels.
        times = time_calls(step, min_steps, budget_s, warmup=2)
    return summary(times)


def _measure_inference(net, batch_size, threads, budget_s):
    flags, info = net_flags(net)
    torch.manual_seed(0)
    with torch_threads(threads):
        # In the acting model's layout; training mode: actors sample their actions.
        model = models.to_acting_layout(build_net(flags, info))
        rollout = random_rollout(flags, info, 1, batch_size)
        inputs = {k: rollout[k] for k in ("frame", "reward", "done", "last_action")}
        state = model.initial_state(batch_size)

        def forward():
            with torch.no_grad():
                outputs, _ = model(inputs, state)
            # As an actor does: its outputs go to NumPy to be written into the buffers.
            return {k: v[0].numpy() for k, v in outputs.items()}

        times = time_calls(forward, 10, budget_s, warmup=5)
    return summary(times)
