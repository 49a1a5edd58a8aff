"""A batch of environments stepped together: what an actor or an env-server stream drives.

    actions [N] (float32 [N, A] for a Box action space) -> VectorEnv.step
        -> dict of arrays [N, ...], one per env field of the
        rollout schema (beast/rollout.py; `fields` lists them)

Each row follows RolloutAdapter's convention (see beast/envs.py): a step that ends an episode
returns the next episode's first frame, with the reward, done and episode totals of the step that
ended it. Two backends, chosen with --env_backend:

  * gymnasium: N environments from `create_env`, each behind a RolloutAdapter, stepped one after
    the other in this process. An environment that raises is closed, replaced by a fresh one
    (whose first step reads done=True), and counted; the others go on.
  * envpool: one EnvPool of N Atari environments, stepped by EnvPool's C++ threads without the
    GIL (beast/envpool_backend.py EnvPoolVectorEnv).

MonoBeast's actors (monobeast.Sampler) and PolyBeast's env servers (polybeast_env) both build their
environments here, so a backend added here serves both variants.
"""

import sys
import traceback

import numpy as np

from beast import envs


def create_vector_env(flags, num_envs, seed, on_error=None, name="actor"):
    """N environments as one VectorEnv.

    Args:
      flags: needs env, env_backend, episodic_life (and what create_env reads).
      num_envs: N, the batch size of every call.
      seed: an int; environment j is seeded from (seed, j) and, after a restart, from the
        restart count as well, so no two environments share a seed.
      on_error: called with no arguments whenever an environment is restarted after an error;
        returns the restart number used for the new seed (None: count locally).
      name: who owns the environments, for error messages.
    """
    if num_envs < 1:
        raise ValueError(f"a vector env needs at least one environment (got {num_envs})")
    envs.check_backend(flags)
    if flags.env_backend == "envpool":
        from beast import envpool_backend  # EnvPool loads only for the runs that ask for it

        return envpool_backend.EnvPoolVectorEnv(flags, num_envs, seed)
    return GymnasiumVectorEnv(flags, num_envs, seed, on_error, name)


def nonfinite_problem(outputs, env_id):
    """What is wrong with a step of N environments (arrays [N, ...]) that holds NaN or inf
    in a float field (the reward first: a NaN there makes the episode return NaN too), in
    words naming the field, the environment and `env_id`; None when every value is finite.
    The model takes the reward and the observation, and a NaN there makes NaN logits.
    last_action is the agent's own and is not looked at."""
    names = sorted(outputs, key=lambda name: name != "reward")
    for name in names:
        array = outputs[name]
        if name == "last_action" or array.dtype.kind != "f" or np.isfinite(array).all():
            continue
        where = tuple(np.argwhere(~np.isfinite(array))[0])  # (environment, ...)
        return (f"environment {where[0]} of {env_id} returned {array[where]} as its {name!r}; "
                "the learner takes finite values only: fix the environment (or the wrapper, "
                "beast/envs.py WRAPPERS) so that its rewards and observations stay finite.")
    return None


def env_seed(seed, j, restart=0):
    """The seed of environment j of a vector env seeded with `seed`, after `restart` restarts.

    Distinct for distinct (seed, j, restart) and below 2**31, since some environments
    (MinAtar's NumPy seeding) refuse seeds of 2**32 and more.
    """
    return int(np.random.SeedSequence([seed, j, restart]).generate_state(1)[0] % 2**31)


class GymnasiumVectorEnv:
    """N RolloutAdapters stepped in turn. The returned arrays are reused by the next call:
    copy what you keep."""

    def __init__(self, flags, num_envs, seed, on_error=None, name="actor"):
        self.flags = flags
        self.num_envs = num_envs
        self.seed = seed
        self.on_error = on_error
        self.name = name
        self.restarts = 0
        self.envs = [self._make_env(j, 0) for j in range(num_envs)]
        self.fields = self.envs[0].fields
        box = self.envs[0].box
        self.actions_shape = (num_envs,) if box is None else (num_envs, box.size)
        self.outputs = {f.name: np.zeros((num_envs,) + f.shape, dtype=f.dtype)
                        for f in self.fields}

    def _make_env(self, j, restart):
        return envs.RolloutAdapter(envs.create_env(self.flags),
                                   seed=env_seed(self.seed, j, restart))

    def _store(self, rows):
        """rows[j] (a dict of env j's values) into the output arrays, field by field: one
        assignment of N values per field costs less than N assignments of one value."""
        for key, array in self.outputs.items():
            array[...] = [row[key] for row in rows]

    def initial(self):
        self._store([env.initial() for env in self.envs])
        return self.outputs

    def step(self, actions):
        actions = np.asarray(actions)
        if actions.shape != self.actions_shape:
            raise ValueError(f"expected {self.num_envs} actions, an array of shape "
                             f"{self.actions_shape}, got one of shape {actions.shape}")
        rows = []
        for j, env in enumerate(self.envs):
            try:
                rows.append(env.step(actions[j]))  # the adapter takes an int or a row [A]
            except Exception:  # A broken environment must not end the run.
                rows.append(self._restart(j))
        self._store(rows)
        return self.outputs

    def _restart(self, j):
        traceback.print_exc()
        print(f"[{self.name}] environment {j} raised in step; restarting it.", file=sys.stderr)
        self.envs[j].close()
        restart = self.on_error() if self.on_error is not None else None
        if restart is None:
            self.restarts += 1
            restart = self.restarts
        self.envs[j] = self._make_env(j, restart)
        return self.envs[j].initial()

    def close(self):
        for env in self.envs:
            env.close()
