"""The machine line of bench reports: the CPU model and its bf16 support, which decide how
much --precision bf16 gains (about 1.7x with AMX, 1.16x with AVX-512 BF16 on this project's
machines)."""

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
    assert run.cpu_description(xeon) == ("Intel(R) Xeon(R) Platinum 8481C", "AMX, AVX-512 BF16")
    epyc = CPUINFO.format(model="AMD EPYC 9B14", flags="avx512f avx512_bf16")
    assert run.cpu_description(epyc) == ("AMD EPYC 9B14", "AVX-512 BF16")
    old = CPUINFO.format(model="Intel(R) Core(TM) i7-6700", flags="")
    assert run.cpu_description(old) == ("Intel(R) Core(TM) i7-6700", "none (emulated)")
    assert run.cpu_description("") == ("unknown", "none (emulated)")
