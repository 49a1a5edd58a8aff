"""How PolyBeast's actor threads, env servers and their streams are laid out: the server
flags, their defaults by kind of environment, and the checks of where the servers are."""

import os

import libpolybeast
from beast import distributed
from beast import flags as beast_flags
from beast import tls
from beast.poly import addresses

# Where the servers are belongs to this start of a run, not to the run: on a
# resume these flags are never taken from the saved flags.json.
# So are the TLS files, which live on the machine that starts it.
PER_START_FLAGS = frozenset({"no_start_servers", "server_addresses", "pipes_basename",
                             "tls_ca", "tls_cert", "tls_key", "tls_server_name"})
# Environments behind each server stream, by kind of environment (beast/flags.py ENV_DEFAULTS).
# On Atari, more streams with fewer environments spread the servers' stepping over the cores.
# Vector tasks: many, so that each stream amortizes its round trip (gRPC, inference) over more
# environments; not more, since every environment in flight adds to the policy lag, which
# slows learning (docs/defaults.md).
ENVS_PER_STREAM = {"atari": 2, "sticky_atari": 2, "image": 32, "vector": 64, "continuous": 16,
                   "nethack": 8}
# The env servers started here, by default: one per core, at most this many, hosting
# DEFAULT_NUM_ACTORS x ENVS_PER_STREAM environments in all. With fewer cores than servers,
# the extra processes only take turns, so fewer servers carry more environments each.
DEFAULT_NUM_ACTORS = 4
# On a GPU machine (beast/machine.py is_gpu_machine) the servers started here are one per core,
# and Atari's streams carry 16 games each: the layout measured there (docs/performance.md).
GPU_MACHINE_ENVS_PER_STREAM = {"atari": 16, "sticky_atari": 16}


def add_server_flags(groups):
    """Where the env servers are, how many, and how their streams are laid out; added to the
    argument groups of beast.flags.add_common_flags."""
    groups.torchbeast.add_argument(
        "--num_actors", type=beast_flags.Number(int, low=1), default=None,
        help="Actor threads, one env server stream each (a stream carries "
             "--envs_per_stream environments); also the number of env servers "
             f"started here (default: one per core, at most {DEFAULT_NUM_ACTORS}, and "
             "without that limit on a GPU machine; "
             "one per address of --server_addresses).")
    groups.environment.add_argument(
        "--envs_per_stream", type=beast_flags.Number(int, 1, libpolybeast.MAX_ENVS_PER_STREAM),
        default=None,
        help="Environments behind each env server stream, stepped together and "
             "sent as one batch, 16 on Atari on a GPU machine (default: "
             f"{beast_flags.describe_defaults(ENVS_PER_STREAM)}; with fewer than "
             f"{DEFAULT_NUM_ACTORS} servers, started here or at "
             "--server_addresses, and --num_actors left to its default, as "
             "many more as keeps the environments in all the same). The servers "
             "started here get it as a flag; the actors ask servers started "
             "elsewhere for it when they open a stream, which those follow unless "
             "started with their own --envs_per_stream.")
    groups.torchbeast.add_argument(
        "--pipes_basename", default=None,
        help="Env server i listens at <pipes_basename>.i, a unix socket: "
             "unix:PATH for gRPC, raw:PATH for the same messages without gRPC "
             "(default: raw:<fresh temporary directory>/env, removed at exit). "
             "The servers started here speak raw messages unless it says "
             "unix:.")
    groups.environment.add_argument(
        "--no_start_servers", action="store_true",
        help="Connect to env servers started elsewhere with `python -m "
             "polybeast_env` (at --server_addresses, or <pipes_basename>.i).")
    groups.environment.add_argument(
        "--server_addresses", default=None,
        help="Comma-separated addresses of running env servers (unix:PATH, "
             "raw:PATH or HOST:PORT); actor i streams from address i mod their "
             "number. Implies --no_start_servers.")
    groups.operations.add_argument(
        "--connect_timeout_s", type=beast_flags.Number(float, above=0), default=60.0,
        help="End the run when an env server that has not yet served this run (no "
             "complete rollout) cannot be reached for this long, or when its streams keep "
             "reaching it but ending before a rollout is complete for this long.")
    groups.operations.add_argument(
        "--reconnect_timeout_s", type=beast_flags.Number(float, above=0), default=3600.0,
        help="End the run when an env server that has served it cannot be reached for this "
             "long (a link that went down, a host that reboots). Until then its actor "
             "retries with backoff while the other servers serve; when none serves, the "
             "learner writes a checkpoint and waits.")
    groups.operations.add_argument(
        "--stream_timeout_s", type=beast_flags.Number(float, above=0), default=30.0,
        help="Cancel a stream and reconnect when its env server sends no step "
             "for this long (a server that went silent). Only the wait for the "
             "server counts, not inference or the learner queue: set it above "
             "the slowest environment step (with --envs_per_stream, the whole "
             "batch's).")


def server_list(flags):
    """The env servers' addresses: this learner rank's share of --server_addresses (all of
    them with one learner), or <pipes_basename>.i for each actor."""
    if flags.server_addresses is not None:
        rank, world_size = distributed.env_rank()
        return distributed.shard(addresses.parse_address_list(flags.server_addresses),
                                 rank, world_size)
    return [f"{flags.pipes_basename}.{i}" for i in range(flags.num_actors)]


def actor_addresses(flags, servers):
    """The env server address of each actor thread: actor i streams from server i mod n."""
    return [servers[i % len(servers)] for i in range(flags.num_actors)]


def default_layout(flags, kind, gpu_machine=False):
    """Fills --num_actors and --envs_per_stream where not given (a resume keeps its own).

    One actor per server: one server per core started here (at most DEFAULT_NUM_ACTORS), or
    one per address of --server_addresses (this rank's share). Their streams carry
    ENVS_PER_STREAM[kind] environments each, or more when there are fewer than
    DEFAULT_NUM_ACTORS servers, so that at least DEFAULT_NUM_ACTORS x ENVS_PER_STREAM[kind]
    environments are in flight: servers started by hand get the layout of the ones started
    here. An explicit --num_actors gets ENVS_PER_STREAM[kind] per stream. On a GPU machine
    the servers started here are one per core, with GPU_MACHINE_ENVS_PER_STREAM's
    environments where it names the kind, and 2 inference threads where not given.
    """
    local = flags.server_addresses is None and not flags.no_start_servers
    chosen = flags.num_actors is None
    if chosen:
        if local and gpu_machine:
            flags.num_actors = beast_flags.default_num_torch_threads()
        elif local:
            flags.num_actors = min(DEFAULT_NUM_ACTORS, beast_flags.default_num_torch_threads())
        else:
            flags.num_actors = _address_count(flags) or DEFAULT_NUM_ACTORS
    if flags.num_inference_threads is None:
        flags.num_inference_threads = 2 if gpu_machine else 1
    if flags.envs_per_stream is None:
        flags.envs_per_stream = ENVS_PER_STREAM[kind]
        if gpu_machine:
            flags.envs_per_stream = GPU_MACHINE_ENVS_PER_STREAM.get(kind, flags.envs_per_stream)
        if chosen:
            total = DEFAULT_NUM_ACTORS * ENVS_PER_STREAM[kind]
            flags.envs_per_stream = max(flags.envs_per_stream, total // flags.num_actors)


def _address_count(flags):
    """This rank's number of --server_addresses; None without them, or when they do not parse
    (_check_servers reports that)."""
    if flags.server_addresses is None:
        return None
    try:
        return len(server_list(flags))
    except ValueError:
        return None


def note_env_flags_of_remote_servers(flags, out):
    """Servers started elsewhere play the environment flags they were started with: an
    environment flag typed here (but --env) sets only this learner's evaluation, test and
    flags.json, and a line on `out` says so and what to do."""
    typed = sorted(set(getattr(flags, "typed", ())) & set(beast_flags.env_flag_names()) - {"env"})
    if flags.no_start_servers and typed:
        names = ", ".join(f"--{name}" for name in typed)
        print(f"note: the env servers were started elsewhere and play the environment flags "
              f"they were started with; {names} typed here reach only this learner's "
              "evaluation and flags.json: give the same to python -m polybeast_env.", file=out)


def unused_rank_flags(flags):
    """--dist_timeout_s typed for a run of one learner rank, which never reads it."""
    if "dist_timeout_s" in getattr(flags, "typed", ()) and distributed.env_rank()[1] == 1:
        return ["--dist_timeout_s is for learner ranks under torchrun, and this run has one: "
                "leave it out, or start it with torchrun --nproc_per_node N."]
    return []


def check_servers(flags):
    """Checks where the env servers are; --server_addresses implies --no_start_servers and,
    unless --num_actors was given, one actor per address."""
    if flags.server_addresses is not None:
        if "pipes_basename" in getattr(flags, "typed", ()):
            return ["--server_addresses and --pipes_basename both say where the env servers "
                    "listen: give one."]
        flags.no_start_servers = True
        try:
            servers = server_list(flags)
        except ValueError as e:
            return [f"--server_addresses: {e}"]
        if not servers:
            return [f"--server_addresses gives fewer addresses than the "
                    f"{distributed.env_rank()[1]} learner ranks: each rank needs its own."]
        if "num_actors" not in flags.given:
            flags.num_actors = len(servers)
    elif flags.no_start_servers and flags.pipes_basename is None:
        return ["--no_start_servers needs --server_addresses (or --pipes_basename) to know "
                "where the env servers listen."]
    if flags.pipes_basename is not None and not addresses.socket_path(flags.pipes_basename):
        return [f"--pipes_basename must be unix:PATH or raw:PATH (got {flags.pipes_basename!r}); "
                "use --server_addresses HOST:PORT,... for TCP."]
    if flags.pipes_basename is not None and flags.server_addresses is None:
        basename = flags.pipes_basename
        if not flags.no_start_servers:
            # LocalEnvServers' own basename
            basename = addresses.rank_basename(basename, *distributed.env_rank())
        problem = addresses.socket_path_problem(f"{basename}.{max(flags.num_actors - 1, 0)}")
        if problem:
            return [f"--pipes_basename: {problem}."]
    if flags.pipes_basename is not None and not flags.no_start_servers:
        directory = os.path.dirname(addresses.socket_path(flags.pipes_basename)) or "."
        if not os.path.isdir(directory):
            return [f"--pipes_basename: the directory {directory} does not exist."]
    return []


def check_tls(flags):
    """TLS is for env servers on other machines: HOST:PORT addresses of --server_addresses."""
    try:
        config = tls.learner_config(flags)
    except ValueError as e:
        return [str(e)]
    if config is None:
        return []
    if flags.server_addresses is None:
        return ["--tls_ca is for env servers started elsewhere (--server_addresses HOST:PORT,...); "
                "the servers this learner starts listen on unix sockets on this machine."]
    sockets = [a for a in addresses.parse_address_list(flags.server_addresses)
               if addresses.socket_path(a)]
    if sockets:
        return [f"--tls_ca is for HOST:PORT addresses; {sockets[0]} is a unix socket on this "
                "machine."]
    return []


def tls_hint(flags, actor_addresses):
    """What to check when servers over TCP did not answer: a TLS handshake that failed looks
    like a server that is not there (gRPC logs some handshake errors above, not all)."""
    if all(addresses.socket_path(a) for a in actor_addresses):
        return ""
    if flags.tls_ca is None:
        return " Servers started with --tls_cert need --tls_ca here."
    return (" With --tls_ca: the servers must serve TLS (--tls_cert) with a certificate signed "
            "by it and made out to the host of each address (or --tls_server_name); servers "
            "started with --tls_client_ca also need --tls_cert and --tls_key here.")
