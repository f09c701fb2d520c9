"""A pytest plugin: the compiles that Keras's own test files make go through `keras_dist.compile`.

Loaded with `-p routing` (tests/keras_suites on sys.path) into a pytest run of the test
files the installed keras ships. Only calls made from a `*_test.py` file are routed:
Keras's own compiles (`compile_from_config` inside `load_model`, `clone_model`) keep
Keras's `compile`, as a script's would. `Trainer.compile` itself is replaced, so Keras's
check for a custom compile (`self.__class__.compile != Trainer.compile`) still sees the
default one. At the end the plugin prints how many compiles it routed; none routed fails
the run, so a run that tested nothing cannot pass.
"""

import sys
import threading

import pytest

import keras_dist
from keras_dist import keras_internals

Trainer = keras_internals.trainer_mixin()  # `BaseTrainer` in Keras 3.16
_keras_compile = Trainer.compile
_inside = threading.local()
routed = {"compiles": 0}


def _compile(self, *args, **kwargs):
    caller = sys._getframe(1).f_code.co_filename
    if getattr(_inside, "active", False) or not caller.endswith("_test.py"):
        return _keras_compile(self, *args, **kwargs)
    _inside.active = True  # a test model's own compile calling super().compile comes back here
    try:
        keras_dist.compile(self, *args, **kwargs)
    finally:
        _inside.active = False
    routed["compiles"] += 1


_compile.__doc__ = _keras_compile.__doc__
Trainer.compile = _compile


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"keras_dist routing: {routed['compiles']} compiles went through keras_dist.compile "
                                f"(strategy: {keras_dist.runtime.current().name})")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if routed["compiles"] == 0 and session.testscollected:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
