"""Builds the `libpolybeast` C++ extension (csrc/) against the system's gRPC and protobuf.

    pip install -e .                      # editable install, puts libpolybeast*.so in the repo root
    python setup.py build_ext --inplace   # the same without installing

Needs gRPC C++, protobuf, their code generators and pkg-config; no libtorch
(arrays cross into Python as NumPy arrays).
"""

import os
import shutil
import subprocess
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

MISSING_DEPENDENCIES = """\
error: building libpolybeast needs gRPC C++ and protobuf ({problem}).
Install them with one of:
  Debian/Ubuntu: apt-get install libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev pkg-config
  conda-forge:   conda install -c conda-forge grpc-cpp libprotobuf pkg-config
  Homebrew:      brew install grpc protobuf pkg-config
then run the build again."""


def _pkg_config(*args):
    return subprocess.run(
        ["pkg-config", *args, "grpc++", "protobuf"], check=True, capture_output=True, text=True
    ).stdout.split()


class BuildWithProtos(build_ext):
    """Generates the gRPC/protobuf C++ code for csrc/rpcenv.proto, then compiles."""

    def build_extension(self, ext):
        problem = None
        if shutil.which("pkg-config") is None:
            problem = "pkg-config not found"
        elif subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"]).returncode != 0:
            problem = "pkg-config cannot find grpc++ and protobuf"
        elif shutil.which("protoc") is None:
            problem = "protoc not found"
        elif shutil.which("grpc_cpp_plugin") is None:
            problem = "grpc_cpp_plugin not found"
        if problem:
            sys.exit(MISSING_DEPENDENCIES.format(problem=problem))

        out_dir = os.path.join(os.path.abspath(self.build_temp), "rpcenv_proto")
        os.makedirs(out_dir, exist_ok=True)
        subprocess.run(
            [
                "protoc",
                "--proto_path=" + os.path.join(HERE, "csrc"),
                "--cpp_out=" + out_dir,
                "--grpc_out=" + out_dir,
                "--plugin=protoc-gen-grpc=" + shutil.which("grpc_cpp_plugin"),
                os.path.join(HERE, "csrc", "rpcenv.proto"),
            ],
            check=True,
        )
        ext.sources += [
            os.path.join(out_dir, "rpcenv.pb.cc"),
            os.path.join(out_dir, "rpcenv.grpc.pb.cc"),
        ]
        ext.include_dirs.append(out_dir)
        ext.extra_compile_args += _pkg_config("--cflags")
        ext.extra_link_args += _pkg_config("--libs")
        super().build_extension(ext)


# Compile the three translation units in parallel (NPY_NUM_BUILD_JOBS overrides).
ParallelCompile("NPY_NUM_BUILD_JOBS", default=0).install()

setup(
    ext_modules=[
        Pybind11Extension(
            "libpolybeast",
            sources=["csrc/libpolybeast.cc"],
            include_dirs=["csrc"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            depends=[os.path.join("csrc", f) for f in os.listdir(os.path.join(HERE, "csrc"))
                     if f.endswith((".h", ".proto"))],
        )
    ],
    cmdclass={"build_ext": BuildWithProtos},
)
