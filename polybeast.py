"""PolyBeast: the scalable IMPALA learner.

Data path:
  env servers (python -m polybeast_env; started here unless --no_start_servers)
    --streams (gRPC; raw messages on unix sockets to the servers started here)-->
         libpolybeast.ActorPool
         (one C++ actor thread per stream)
    --compute((env_outputs, agent_state))--> inference_batcher --> inference threads
         (the acting model on [T=1, B, ...] batches; answer (agent_outputs, agent_state))
    --every unroll_length steps: (rollout [T+1, 1, ...], initial agent state) per
         environment (a stream may carry --envs_per_stream of them)--> learner_queue
    --batch_size rollouts concatenated along dim 1--> learner threads
         (V-trace loss, RMSprop; then new weights -> the acting model).

train() below is the whole run, top to bottom. The actor pool, the batcher and the
inference threads (start_acting) run in a process of their own
(beast/poly/acting_process.py), forked from a CPU learner, spawned beside a CUDA one (a
fork cannot use CUDA), where inference stays on the GPU. Its batches reach the learner
through shared memory, and the learner writes the acting model's weights into its
replicas (shared memory, or GPU memory shared through CUDA IPC).

The services the run calls (flags checked, run directory, resume, logs, checkpoints,
evaluation, learner ranks, --mode test) are beast/training.py, which MonoBeast shares;
the operations of env servers (addresses, layouts, the servers started here, the acting
process and its failures) are beast/poly/. Run `python -m polybeast --help` for the flags.
"""

import argparse
import sys
import time

import numpy as np
import torch

import libpolybeast
from beast import flags as beast_flags
from beast import machine
from beast import restarts
from beast import rollout
from beast import system
from beast import tls
from beast import training
from beast.poly import acting_process
from beast.poly import addresses
from beast.poly import inference_models
from beast.poly import layout
from beast.poly import local_servers


def make_parser():
    parser = argparse.ArgumentParser(
        description="PolyBeast: IMPALA with environment servers and a C++ actor pool.",
        formatter_class=beast_flags.HelpFormatter)
    groups = beast_flags.add_common_flags(parser)
    layout.add_server_flags(groups)
    groups.torchbeast.add_argument(
        "--num_inference_threads", type=beast_flags.Number(int, low=1), default=None,
        help="Threads that run the acting model on batches of actor requests (default: 1; "
             "2 on a GPU machine, a CUDA learner with at least "
             f"{machine.GPU_MACHINE_MIN_CORES} cores).")
    groups.operations.add_argument(
        "--inference_torch_threads", type=beast_flags.Number(int, low=1), default=1,
        help="Intra-op threads of each inference thread (the learner threads "
             "keep --num_torch_threads). One: a batch of single steps is too "
             "small to split.")
    groups.operations.add_argument(
        "--acting_start_method", choices=sorted(acting_process.ACTING_START_METHODS), default=None,
        help="How the acting process starts: fork (the default with the "
             "learner on the CPU: it starts at once) or spawn (the default with "
             "a CUDA learner, whose fork could not use CUDA).")
    groups.operations.add_argument(
        "--acting_timeout_s", type=beast_flags.Number(float, low=0), default=60.0,
        help="Kill and start the acting process again when it has spent this long on its "
             "start or on one inference batch (a deadlock, a stuck forward pass); its Python "
             "stacks are printed first. Env servers that hang are --stream_timeout_s's. "
             "0: never.")
    groups.operations.add_argument(
        "--inference_batch_size", type=beast_flags.Number(int, low=1), default=None,
        help="Most actor requests in one inference forward pass "
             "(default: num_actors).")
    groups.operations.add_argument(
        "--dist_timeout_s", type=beast_flags.Number(float, above=0), default=300.0,
        help="Under torchrun: end the run when another learner rank sends no "
             "heartbeat, or a gradient all-reduce waits, for this long (a rank "
             "that crashed is usually noticed at once).")
    groups.torchbeast.add_argument(
        "--max_learner_queue_size", type=beast_flags.Number(int, low=1), default=None,
        help="Rollouts that may wait for the learner before the actors block; "
             "a short queue keeps the policy lag small (default: batch_size).")
    tls.add_learner_flags(parser.add_argument_group("TLS (env servers on other machines)"))
    return parser


# ----------------------------------------------------------------------------
# Flags.

def inference_batch_size(flags):
    if flags.inference_batch_size is None:
        return max(1, flags.num_actors)
    return flags.inference_batch_size


def learner_queue_size(flags):
    """batch_size by default. A stream hands its envs_per_stream rollouts over at once, so a
    short queue blocks its actor thread until the learner has taken the rest. A longer
    queue (room for two rounds of every stream's unroll, as MonoBeast's --num_buffers) does
    not make a run faster, and it lengthens the policy lag."""
    if flags.max_learner_queue_size is None:
        return flags.batch_size
    return flags.max_learner_queue_size


def resolve_flags(flags, env):
    """Fills PolyBeast's own flags that depend on the environment (env: training.EnvSpec)
    where they were left to their defaults, then checks them; returns the problems found.

    inference_batch_size and max_learner_queue_size stay None when not given (see
    inference_batch_size and learner_queue_size), so that a resume with another
    --num_actors or --batch_size does not inherit sizes derived from the old ones.
    """
    layout.default_layout(flags, env.kind, training.on_gpu_machine(flags))
    # --envs_per_stream's range also holds for servers started elsewhere: the actors ask
    # them for it (create_actor_pool).
    problems = beast_flags.range_problems(flags, make_parser())
    if flags.mode != "train":
        return problems  # --mode test plays locally: no servers, no queues.
    problems += layout.unused_rank_flags(flags)
    problems += layout.check_servers(flags) or layout.check_tls(flags)
    layout.note_env_flags_of_remote_servers(flags, sys.stderr)
    if flags.num_torch_threads is None and not flags.no_start_servers:
        flags.num_torch_threads = beast_flags.default_num_torch_threads(flags.num_actors)
    if learner_queue_size(flags) < flags.batch_size:
        # The queue hands out batch_size rollouts at once: a shorter one never fills.
        problems.append(f"--max_learner_queue_size ({flags.max_learner_queue_size}) must be at "
                        f"least --batch_size ({flags.batch_size}).")
    return problems


# ----------------------------------------------------------------------------
# Acting: inference and the actor pool, in the acting process.

def create_inference_models(flags, env, device):
    """One replica of the model per inference thread, on the learner's device, in
    --acting_precision, for the process that acting_process.acting_context starts."""
    context = acting_process.acting_context(flags, device)
    if context is acting_process.FORK and device.type != "cpu":
        raise training.UserError(
            f"--acting_start_method fork with the learner on {device}: a forked process "
            "cannot use CUDA. Drop --acting_start_method (a CUDA learner spawns it), or add "
            "--disable_cuda.")
    replicas = [training.build_acting_model(flags, env, device)
                for _ in range(flags.num_inference_threads)]
    return inference_models.InferenceModels(replicas, context=context)


def to_torch(array, device):
    """A numpy array (owned by the C++ side, or a view of one) as a tensor on device.

    On the CPU this is torch.from_numpy: no copy. Towards a GPU the data goes
    through pinned memory so the copy can run asynchronously.
    """
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def inference(index, inference_batcher, acting_model, weights_step, schema, device,
              busy_since, torch_threads=1):
    """Inference thread: answers batches of actor requests until the batcher closes.

    A batch holds one step of B actors: env_outputs arrays are [T=1, B, ...]
    and the agent state arrays [layers, B, hidden]. obs[t] -> action[t]. Every
    output of the model goes back: each is a field of the rollout. busy_since: this
    thread's clock for the learner's watchdog (--acting_timeout_s), 0 while it waits.
    """
    system.set_intra_op_threads(torch_threads)
    busy_since.value = 0.0  # started: from here only a batch counts
    for batch in inference_batcher:
        busy_since.value = time.time()
        env_outputs, agent_state = batch.get_inputs()
        check_env_outputs(schema, env_outputs)
        inputs = {k: to_torch(v, device) for k, v in env_outputs.items()}
        state = tuple(to_torch(s, device) for s in agent_state)
        # Before the forward pass: the learner may write newer weights meanwhile.
        acted_with = int(weights_step)
        outputs, state = acting_model.forward(index, inputs, state)
        # The only device-to-host copy (and sync point) of an inference step.
        agent_outputs = {k: v.cpu().numpy() for k, v in outputs.items()}
        agent_outputs[rollout.POLICY_STEP.name] = np.full(
            env_outputs["reward"].shape, acted_with, np.int64)
        batch.set_outputs((agent_outputs, tuple(s.cpu().numpy() for s in state)))
        busy_since.value = 0.0


def check_env_outputs(schema, env_outputs):
    """What the env servers send enters here: each field's dtype and shape must be the
    run's, or the model would fail on it (or, worse, not: done as uint8 makes ~done 254)."""
    try:
        schema.check(env_outputs, 2, "an env server sent a step that does not fit",
                     source="env")
    except ValueError as e:
        raise training.UserError(
            f"{e}. Do the env servers run the same --env as the learner?") from None
    # Values the model cannot take. (The actor pool refuses NaN and inf in what the servers
    # send, rewards included, naming the server: libpolybeast.BadStep.)
    last_action = env_outputs["last_action"]
    for name in rollout.observation_names(env_outputs):  # frame, or a Dict's entries
        frame = env_outputs[name]
        if frame.dtype.kind == "f" and not np.isfinite(frame).all():
            raise training.UserError(f"an env server sent an observation ({name!r}) with NaN or "
                                     "inf in it; the environment (or a wrapper) produced it.")
    if schema.continuous:
        # Our own actions coming back, but from another process: NaN would reach the model.
        if not np.isfinite(last_action).all():
            raise training.UserError("an env server sent a last_action with NaN or inf in it.")
        return
    num_actions = schema.num_actions
    if last_action.size and (last_action.min() < 0 or last_action.max() >= num_actions):
        raise training.UserError(
            f"an env server sent a last_action outside [0, {num_actions}) "
            f"(min {last_action.min()}, max {last_action.max()}).")


def run_actor_pool(actor_pool, addresses, flags):
    try:
        actor_pool.run()
    except libpolybeast.BadStep as e:  # what a server sent, not where: no address to check
        raise training.UserError(str(e)) from None
    except RuntimeError as e:  # the first actor's error; it also closed the queues
        raise training.UserError(
            f"{e}\nThe actors stream from {', '.join(sorted(set(addresses)))}; start env "
            "servers there (python -m polybeast_env) or check --server_addresses / "
            f"--pipes_basename.{layout.tls_hint(flags, addresses)}") from None


def create_actor_pool(flags, schema, acting_model, addresses):
    """The learner queue, the inference batcher and the actor pool that feeds them."""
    learner_queue = libpolybeast.BatchingQueue(
        batch_dim=1, minimum_batch_size=flags.batch_size, maximum_batch_size=flags.batch_size,
        maximum_queue_size=learner_queue_size(flags))
    # Minimum 1: a batch is whatever requests came in during the previous
    # forward pass, so no actor waits for others to catch up.
    inference_batcher = libpolybeast.DynamicBatcher(
        batch_dim=1, minimum_batch_size=1, maximum_batch_size=inference_batch_size(flags))
    # The agent state of one actor has batch dim 1: [layers, 1, hidden].
    initial_agent_state = tuple(s.numpy() for s in acting_model.replicas[0].initial_state(1))
    actor_pool = libpolybeast.ActorPool(
        unroll_length=flags.unroll_length, learner_queue=learner_queue,
        inference_batcher=inference_batcher, env_server_addresses=addresses,
        initial_agent_state=initial_agent_state, connect_timeout_s=flags.connect_timeout_s,
        stream_timeout_s=flags.stream_timeout_s, env_keys=list(schema.names("env")),
        envs_per_stream=flags.envs_per_stream,
        # int64 0, or float32 zeros [A] for a Box action space (single-environment streams).
        initial_last_action=schema.zeros((), source="env")["last_action"],
        tls=tls.learner_config(flags), reconnect_timeout_s=flags.reconnect_timeout_s)
    return learner_queue, inference_batcher, actor_pool


def start_acting(errors, flags, schema, acting_model, weights_step, addresses, device,
                 busy_since):
    """Starts the actor pool's thread and the inference threads; returns (learner_queue,
    the queues to close at the end, the started threads, the actor pool). errors: the
    training.ThreadErrors that keeps their exceptions; weights_step: the learner step of the
    acting model's weights (learner.Learner.weights_step); busy_since: a clock per inference
    thread (acting_process.ActorPoolProcess.check)."""
    learner_queue, inference_batcher, actor_pool = create_actor_pool(
        flags, schema, acting_model, addresses)
    threads = [errors.thread("actor-pool", run_actor_pool, actor_pool, addresses, flags)]
    threads += [errors.thread(f"inference-{i}", inference, i, inference_batcher, acting_model,
                              weights_step, schema, device, busy_since[i],
                              flags.inference_torch_threads, on_error=inference_batcher.close)
                for i in range(flags.num_inference_threads)]
    for thread in threads:
        thread.start()
    return learner_queue, (learner_queue, inference_batcher, actor_pool), threads, actor_pool


# ----------------------------------------------------------------------------
# The run.

def train(flags):
    """Trains until --total_steps or a stop request; the last checkpoint is written whatever
    ended it. Under torchrun, this process is one of several learner ranks."""
    with training.Setup(flags, resolve_flags, distributed_ok=True) as setup, \
            local_servers.local_env_servers(flags) as servers:  # they boot meanwhile
        acting_model = create_inference_models(flags, setup.env, setup.device)
        with training.Run(setup, acting_model) as run:
            actor_addresses = wait_for_servers(run, servers)
            policy, env_errors = restarts.RestartPolicy(), 0
            while actor_addresses and not run.done() and not run.stop.is_set():
                if policy.restarts:  # after a restart: new locks, the learner's latest weights
                    acting_model.renew_locks()
                    run.learner.publish()
                actors = acting_process.ActorPoolProcess(run, acting_model, actor_addresses,
                                                         start_acting, env_errors)
                learners = [run.thread(f"learner-{i}", learn, run, actors.batches(run.device))
                            for i in range(flags.num_learner_threads)]
                for thread in learners:
                    thread.start()
                try:
                    while run.running():
                        actors.check()  # its error, or ActingDied when the process is gone
                        if servers is not None:
                            servers.check()  # started again when a signal killed them
                        run.check_threads(learners + actors.threads)
                        run.housekeeping(env_errors=actors.env_errors())
                except acting_process.ActingDied as died:
                    restarts.start_again_or_stop(policy, died, actors.started,
                                                 "It is not started again", "Starting it again")
                finally:
                    actors.close()
                    acting_process.close_and_join([], learners + actors.threads)
                    env_errors = actors.env_errors()


def learn(run, batches):
    """A learner thread: batch -> update -> record, until total_steps or the end of
    `batches` (the acting process stopped)."""
    system.set_intra_op_threads(run.flags.num_torch_threads)
    for batch, initial_agent_state in run.stats.timed(batches):
        step, stats = run.learner.update(batch, initial_agent_state)
        run.record(step, stats, batch)  # logs.csv, evaluation snapshots
        if run.done():
            return


def wait_for_servers(run, servers):
    """The env server address of each actor thread, once the servers started here listen;
    None when a stop came first. For servers started elsewhere, a warning when they are
    reached over the network without TLS."""
    flags = run.flags
    if servers is not None:
        servers.wait_until_listening(flags.connect_timeout_s, run.stop)
        if run.stop.is_set():
            print("Stopping on request before training started.", file=sys.stderr)
            return None
        return servers.addresses
    actor_addresses = layout.actor_addresses(flags, layout.server_list(flags))
    remote = sorted({a for a in actor_addresses if not addresses.is_loopback(a)})
    if remote and flags.tls_ca is None:
        print(f"warning: the env servers at {', '.join(remote)} are reached over the "
              "network; the traffic is neither authenticated nor encrypted (see --tls_ca).",
              file=sys.stderr)
    return actor_addresses


def test(flags):
    """--mode test: plays --test_episodes with the run's checkpoint, here (no servers)."""
    return training.test(flags, resolve_flags)


def main(argv=None):
    """Runs --mode train or test; returns the exit code (2 for a problem the user can fix)."""
    parser = make_parser()
    flags = training.parse_flags(parser, argv, always_given=layout.PER_START_FLAGS)
    return training.run_command(train, test, flags)


if __name__ == "__main__":
    sys.exit(main())
