"""The machine a run or a report names: the CPU model and its bf16 support, which decide how
much bf16 gains and whether --precision auto chooses it."""

import json

import pytest

from beast import flags as beast_flags
from beast import machine
from beast import runlog
from bench import null_env
from bench import run

CPUINFO = """processor\t: 0
model name\t: {model}
flags\t\t: fpu sse2 avx2 {flags}

processor\t: 1
model name\t: {model}
flags\t\t: fpu sse2 avx2 {flags}
"""


def test_cpu_description_reads_the_model_and_bf16_flags():
    xeon = CPUINFO.format(model="Intel(R) Xeon(R) Platinum 8481C",
                          flags="avx512f avx512_bf16 amx_bf16 amx_tile")
    assert machine.cpu_description(xeon) == ("Intel(R) Xeon(R) Platinum 8481C", "AMX, AVX-512 BF16")
    epyc = CPUINFO.format(model="AMD EPYC 9B14", flags="avx512f avx512_bf16")
    assert machine.cpu_description(epyc) == ("AMD EPYC 9B14", "AVX-512 BF16")
    old = CPUINFO.format(model="Intel(R) Core(TM) i7-6700", flags="")
    assert machine.cpu_description(old) == ("Intel(R) Core(TM) i7-6700", "none (emulated)")
    assert machine.cpu_description("") == ("unknown", "none (emulated)")


def test_a_runs_metadata_names_its_machine(tmp_path, monkeypatch):
    """meta.json says what the run ran on; a CPU run names no GPU and never asks CUDA."""
    monkeypatch.setattr(machine, "this_cpu", lambda: ("AMD EPYC 9B14", "AVX-512 BF16"))
    asked = []
    monkeypatch.setattr("torch.cuda.get_device_name", lambda d: asked.append(d))
    run_dir = runlog.RunDir(str(tmp_path), "run")
    runlog.write_metadata(run_dir, {"env": "CartPole-v1"},
                          dict(machine=machine.describe("cpu")))
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["machine"] == {"cpu": "AMD EPYC 9B14", "cpu_bf16": "AVX-512 BF16",
                               "cores": machine.cores(), "gpu": None}
    assert asked == [] and machine.cores() >= 1


def test_a_cuda_learner_is_described_by_its_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.get_device_name", lambda d: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr("torch.version.cuda", "13.0")
    assert machine.gpu_description("cuda") == "NVIDIA H100 80GB HBM3 (CUDA 13.0)"
    assert machine.describe("cuda")["gpu"] == "NVIDIA H100 80GB HBM3 (CUDA 13.0)"


def test_the_bench_header_names_the_cpu_and_the_gpu(monkeypatch):
    monkeypatch.setattr(machine, "this_cpu", lambda: ("AMD EPYC 9B14", "AVX-512 BF16"))
    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: False)
    args = run.make_parser().parse_args(["--quick", "--duration", "15"])
    header = "\n".join(run.machine_header(args, 2))
    assert "AMD EPYC 9B14" in header and "AVX-512 BF16" in header
    assert "GPU: none" in header


def test_env_ceiling_steps_a_vector_env_and_counts_every_environment(monkeypatch):
    """env_sps goes through beast.vector_envs, as actors and servers do, and one call of
    its step() counts as VECTOR_ENVS environment steps."""
    from bench import ceilings

    calls = []
    real = ceilings.vector_envs.create_vector_env

    def spy(flags, num_envs, seed):
        env = real(flags, num_envs, seed)
        step = env.step

        def counted(actions):
            calls.append(len(actions))
            return step(actions)

        env.step = counted
        return env

    monkeypatch.setattr(ceilings.vector_envs, "create_vector_env", spy)
    result = ceilings._measure_env(null_env.ENV_ID, seconds=0.2, chunks=1)
    assert set(calls) == {ceilings.VECTOR_ENVS}
    timed = len(calls) - 50  # after the warm-up steps
    assert result["n"] == 1 and result["median"] > 0
    # CPU time per environment step: the process's time over every timed env step, so at most
    # the wall time of the chunk over those steps (one thread), not VECTOR_ENVS times more.
    assert result["core_us"] <= 1.5 * 0.2e6 / (timed * ceilings.VECTOR_ENVS) + 50


@pytest.mark.parametrize("cpu_bf16, device, expected", [
    ("AMX, AVX-512 BF16", "cpu", "bf16"), ("AVX-512 BF16", "cpu", "bf16"),
    ("none (emulated)", "cpu", "fp32"), ("AMX, AVX-512 BF16", "cuda", "fp32")])
def test_auto_precision_is_bf16_where_a_cpu_learner_has_bf16_instructions(cpu_bf16, device,
                                                                          expected):
    flags = beast_flags.apply_env_defaults(beast_flags.common_parser().parse_args([]),
                                           "atari")
    assert (flags.precision, flags.acting_precision) == ("auto", "auto")
    chosen = beast_flags.resolve_precisions(flags, device, cpu_bf16=cpu_bf16)
    assert (flags.precision, flags.acting_precision) == (expected, expected)
    for name in ("precision", "acting_precision"):
        assert chosen[name]["value"] == expected
        assert chosen[name]["why"].startswith("auto") and cpu_bf16 in chosen[name]["why"]


def test_a_typed_precision_and_the_small_nets_defaults_stay_as_they_are():
    flags = beast_flags.common_parser().parse_args(["--acting_precision", "fp32"])
    flags.given = {"acting_precision"}
    beast_flags.apply_env_defaults(flags, "atari")
    chosen = beast_flags.resolve_precisions(flags, "cpu", cpu_bf16="AMX")
    assert (flags.precision, flags.acting_precision) == ("bf16", "fp32")
    assert chosen["acting_precision"] == {"value": "fp32", "why": "typed"}
    for kind in ("image", "vector", "continuous"):
        flags = beast_flags.apply_env_defaults(beast_flags.common_parser().parse_args([]),
                                               kind)
        beast_flags.resolve_precisions(flags, "cpu", cpu_bf16="AMX")
        assert (flags.precision, flags.acting_precision) == ("fp32", "fp32"), kind


def test_the_bound_of_a_sticky_workload_times_the_learner_with_its_kinds_loss_flags():
    """The compute bound of Pong with sticky actions times the learner as the run trains:
    the trust region (pg_clip) and batches of 8 of its kind, not the Atari net's flags."""
    pytest.importorskip("ale_py")
    from bench import ceilings
    from bench import endtoend

    workload = endtoend.resolve(endtoend.Workload("k", "monobeast", "ALE/Pong-v5", "l", []))
    assert workload.net.kind == "sticky_atari"
    flags, info = ceilings.net_flags(workload.net)
    assert (flags.model, flags.channels, flags.batch_size, flags.pg_clip) == (
        "resnet", [8, 16, 16], 8, 0.4)
    atari, _ = ceilings.net_flags(workload.net._replace(kind=None))
    assert atari.pg_clip == 0.0
