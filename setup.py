"""Builds keras_dist's one compiled part; everything else is declared in setup.cfg.

`keras_dist/_bind_address.so` is a plain C library that keras_dist preloads (LD_PRELOAD)
into the processes of a cluster on one machine, so their TensorFlow servers listen on
loopback only (see keras_dist/tf_cluster.py). LD_PRELOAD is a Linux (glibc/musl) feature.
The extension is optional: where no C compiler works, keras_dist installs without it, and
a local cluster says in one line that its servers listen on all interfaces.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildPreloadLibrary(build_ext):
    """Names the library `_bind_address.so`: it is preloaded, never imported by Python."""

    def get_ext_filename(self, fullname):
        return fullname.replace(".", "/") + ".so"


setup(
    ext_modules=[Extension("keras_dist._bind_address", ["keras_dist/bind_address.c"], libraries=["dl"],
                           optional=True)]
    if sys.platform.startswith("linux") else [],
    cmdclass={"build_ext": BuildPreloadLibrary},
)
