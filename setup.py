"""Builds keras_dist's one compiled part; everything else is declared in setup.cfg.

`keras_dist/_bind_address.so` is a plain C library that keras_dist preloads (LD_PRELOAD)
into the processes of a cluster on one machine, so their TensorFlow servers listen on
loopback only (see keras_dist/launchers/binding.py). LD_PRELOAD is a Linux (glibc/musl) feature.
The extension is optional: where no C compiler works, keras_dist installs without it, and
a local cluster says in one line that its servers listen on all interfaces.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext


class BuildPreloadLibrary(build_ext):
    """Names the library `_bind_address.so`: it is preloaded, never imported by Python."""

    def get_ext_filename(self, fullname):
        return fullname.replace(".", "/") + ".so"


class WheelTaggedByWhatItHolds(bdist_wheel):
    """A wheel built without the library (no compiler) holds Python only: tagged py3-none-any,
    it installs wherever Python runs, not only on this platform and Python version."""

    def get_tag(self):
        built = [path for path in self.get_finalized_command("build_ext").get_outputs() if os.path.exists(path)]
        if self.distribution.ext_modules and not built:
            self.root_is_pure = True
            return "py3", "none", "any"
        return super().get_tag()


setup(
    ext_modules=[Extension("keras_dist._bind_address", ["keras_dist/bind_address.c"], libraries=["dl"],
                           optional=True)]
    if sys.platform.startswith("linux") else [],
    cmdclass={"build_ext": BuildPreloadLibrary, "bdist_wheel": WheelTaggedByWhatItHolds},
)
