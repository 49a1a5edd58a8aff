"""Where the time of a null-environment step goes.

MonoBeast: its own pieces (monobeast.Sampler, get_batch, learner.Learner.update)
run in this process on Null-v0 with the tiny MLP, with one intra-op thread, each
part timed with perf_counter accumulators that wrap the methods of these
objects (nothing in the repo is changed). Every cost is given in microseconds
per environment step, i.e. core-microseconds: the sum is what one step costs
when nothing waits for anything.

PolyBeast: `py-spy record --format raw` on a running null-env run (learner
process and env servers), summarised by thread role and by innermost frame.
py-spy sees Python frames only: the C++ actor threads of libpolybeast show up
only through the Python calls they make.
"""

import collections
import contextlib
import multiprocessing
import queue
import re
import shutil
import subprocess
import time

import torch

import monobeast
from beast import flags as beast_flags
from beast import learner
from beast import rollout
from beast import runlog
from beast import training

from bench import ceilings
from bench import null_env


class Accumulators:
    """Seconds spent in each wrapped callable."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)

    def wrap(self, name, fn):
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return timed

    def reset(self):
        self.seconds.clear()


class _NullLogger:
    def log(self, step, stats):
        pass


@contextlib.contextmanager
def _patched(module, name, value):
    """Replaces module.name for the duration (only in this process)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def null_flags(argv):
    flags = training.parse_flags(monobeast.make_parser(), ["--env", null_env.ENV_ID, *argv])
    info = training.env_spec(flags)
    beast_flags.apply_env_defaults(flags, info.kind)
    problems = monobeast.resolve_flags(flags, info)
    if problems:
        raise ValueError("; ".join(problems))
    flags.total_steps = 10**12
    return flags, info


def profile_monobeast(argv, budget_s):
    """MonoBeast's parts on Null-v0, timed in this process.

    Returns (rows, context): rows are (part, microseconds per env step, side),
    side being "actor", "hand-off" or "learner"; context describes the setup.
    """
    flags, info = null_flags(argv)
    with ceilings.torch_threads(1):
        torch.manual_seed(0)
        model = training.build_model(flags, info)
        schema = rollout.Schema.of(info.env_fields, model, info.num_actions)
        buffers = monobeast.create_buffers(flags, schema)
        state_buffers = monobeast.create_state_buffers(model, flags.num_buffers)
        actor_rows, unrolls = profile_actor(flags, model, schema, buffers, state_buffers,
                                            budget_s)
        hand_off_rows = profile_hand_off(flags.unroll_length)
        learner_rows, steps = profile_learner(flags, info, buffers, state_buffers, budget_s)
    context = dict(unroll_length=flags.unroll_length, batch_size=flags.batch_size,
                   envs_per_actor=flags.envs_per_actor, unrolls=unrolls, learner_steps=steps,
                   hidden_size=flags.hidden_size)
    return actor_rows + hand_off_rows + learner_rows, context


def profile_actor(flags, model, schema, buffers, state_buffers, budget_s):
    """The actor: one Sampler stepping envs_per_actor environments, unrolling for
    budget_s (5 unrolls at least) after one unroll of warm-up.

    Returns (rows, number of unrolls timed).
    """
    T, k = flags.unroll_length, flags.envs_per_actor
    acc = Accumulators()
    sampler = monobeast.Sampler(flags, model, schema, buffers, state_buffers, k, seed=0)
    _time_sampler_parts(sampler, acc)
    indices = list(range(k))
    sampler.unroll(indices)  # warm-up
    acc.reset()
    unrolls, start = 0, time.perf_counter()
    while unrolls < 5 or time.perf_counter() - start < budget_s:
        sampler.unroll(indices)
        unrolls += 1
    total = time.perf_counter() - start
    sampler.close()
    s = dict(acc.seconds)
    per_step = 1e6 / (unrolls * T * k)  # seconds -> microseconds per env step
    # The wrapped calls nest (env inside adapter inside vector inside step_envs; forward
    # inside act), so each part is its time less that of the part inside it.
    parts = [
        ("NullEnv.step (the environment itself)", s["env"]),
        ("RolloutAdapter.step bookkeeping", s["adapter"] - s["env"]),
        ("GymnasiumVectorEnv.step loop, stacking into [k] arrays",
         s["vector"] - s["adapter"]),
        ("Sampler._step_envs: _store into the current step", s["step_envs"] - s["vector"]),
        (f"model forward (T=1, batch {k}, no grad)", s["forward"]),
        ("Sampler._act around the forward (inputs, outputs to NumPy)",
         s["act"] - s["forward"]),
        ("Sampler._write into the shared buffers", s["write"]),
        ("Sampler.unroll rest (loop, state copy, step 0)",
         total - s["step_envs"] - s["act"] - s["write"]),
    ]
    return [(name, seconds * per_step, "actor") for name, seconds in parts], unrolls


def _time_sampler_parts(sampler, acc):
    """Wraps the sampler's parts, down to each environment's step, in acc's timers."""
    vector = sampler.envs  # a beast.vector_envs.GymnasiumVectorEnv
    for adapter in vector.envs:
        adapter.env.step = acc.wrap("env", adapter.env.step)
        adapter.step = acc.wrap("adapter", adapter.step)
    vector.step = acc.wrap("vector", vector.step)
    sampler._step_envs = acc.wrap("step_envs", sampler._step_envs)
    sampler.model = acc.wrap("forward", sampler.model)
    sampler._act = acc.wrap("act", sampler._act)
    sampler._write = acc.wrap("write", sampler._write)


def profile_hand_off(T):
    """The hand-off: each rollout's buffer index travels free -> actor -> full -> learner.

    Returns its one row.
    """
    ctx = multiprocessing.get_context("fork")
    index_queue = ctx.SimpleQueue()
    n = 2000
    start = time.perf_counter()
    for i in range(n):
        index_queue.put(i)
    for _ in range(n):
        index_queue.get()
    pair_s = (time.perf_counter() - start) / n
    index_queue.close()
    # Two put+get pairs per rollout of T steps (free_queue and full_queue).
    return [("mp.SimpleQueue put+get of buffer indices (same process; no wake-ups)",
             2 * pair_s * 1e6 / T, "hand-off")]


def profile_learner(flags, info, buffers, state_buffers, budget_s):
    """The learner: learner steps for budget_s (20 at least) after 3 of warm-up.

    Returns (rows, number of learner steps timed).
    """
    T, B = flags.unroll_length, flags.batch_size
    acc = Accumulators()
    one_learner_step = _learner_step(flags, info, buffers, state_buffers, acc)
    with _patched(learner, "learn_step", acc.wrap("learn_step", learner.learn_step)), \
            _patched(learner, "episode_stats", acc.wrap("episode_stats",
                                                        learner.episode_stats)):
        for _ in range(3):
            one_learner_step()
        acc.reset()
        steps, start = 0, time.perf_counter()
        while steps < 20 or time.perf_counter() - start < budget_s:
            one_learner_step()
            steps += 1
    s = dict(acc.seconds)
    per_step = 1e6 / (steps * T * B)
    parts = [
        (f"get_batch (index_select of {B} buffers)", s["get_batch"]),
        (f"learn_step (forward T+1={T + 1} x B={B}, V-trace, backward, RMSprop)",
         s["learn_step"]),
        ("weight publish (actor_model.load_state_dict)", s["publish"]),
        ("episode_stats", s["episode_stats"]),
        ("Learner.update and TrainingStats.record rest (locks, counters, stats dict)",
         s["learn"] - s["learn_step"] - s["publish"] - s["episode_stats"]),
    ]
    return [(name, seconds * per_step, "learner") for name, seconds in parts], steps


def _learner_step(flags, info, buffers, state_buffers, acc):
    """A function taking one learner step as monobeast.learn does: get_batch, then
    Learner.update (learn_step, weight publish) and TrainingStats.record
    (episodes, stats), with get_batch, learn and the publish timed in acc.

    The queues are filled by hand, in this thread: the hand-off is timed apart.
    """
    B = flags.batch_size
    actor_model = training.build_model(flags, info)
    learner_model = training.build_model(flags, info)
    run_learner = learner.Learner(flags, learner_model, actor_model)
    run_stats = runlog.TrainingStats(flags, _NullLogger(), 0)
    actor_model.load_state_dict = acc.wrap("publish", actor_model.load_state_dict)

    def learn(batch, initial_agent_state):
        step, stats = run_learner.update(batch, initial_agent_state)
        run_stats.record(step, stats, *learner.episode_stats(batch))

    full_queue, free_queue = queue.SimpleQueue(), queue.SimpleQueue()
    timed_get_batch = acc.wrap("get_batch", monobeast.get_batch)
    timed_learn = acc.wrap("learn", learn)
    device = torch.device("cpu")

    def one_learner_step():
        for i in range(B):
            full_queue.put(i)
        item = timed_get_batch(flags, full_queue, free_queue, buffers, state_buffers, device)
        for _ in range(B):
            free_queue.get()
        timed_learn(*item)

    return one_learner_step


# ---------------------------------------------------------------------------------------------
# py-spy on PolyBeast.

def pyspy_available():
    return shutil.which("py-spy") is not None


def pyspy_record(pid, seconds, rate, out_path):
    """Records `pid` and its children without pausing them; returns py-spy's exit status
    and its output (stderr+stdout)."""
    command = ["py-spy", "record", "--format", "raw", "--pid", str(pid), "--subprocesses",
               "--nonblocking", "--rate", str(rate), "--duration", str(int(seconds)),
               "--output", out_path]
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    return result.returncode, (result.stderr + result.stdout)[-1500:]


_PROCESS = re.compile(r'process \d+:"[^"]*";?')


def summarize_pyspy(path, seconds, rate, top=10):
    """Parses py-spy's raw (collapsed stack) output.

    Returns (roles, leaves, total): roles and leaves are lists of (name, samples),
    most samples first; a thread role is "<process> / <thread entry function>".
    Dividing samples by seconds * rate gives the average number of busy threads.
    """
    roles = collections.Counter()
    leaves = collections.Counter()
    total = 0
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            count = int(count)
            # Process entries ('process 12:"<command line>"') may hold ';' themselves.
            processes = _PROCESS.findall(stack)
            frames = [fr for fr in _PROCESS.sub("", stack).split(";") if fr]
            process = "env servers" if any("polybeast_env" in p for p in processes) \
                else "learner process"
            if frames and frames[0].startswith("Thread._bootstrap") and len(frames) > 3:
                thread = frames[3].rpartition(" (")[0] or frames[3]
            elif frames and frames[0].startswith("_bootstrap (multiprocessing"):
                thread = "server main"
            else:
                thread = "main thread"
            roles[f"{process} / {thread}"] += count
            if frames:
                leaves[frames[-1]] += count
            total += count
    return roles.most_common(), leaves.most_common(top), total
