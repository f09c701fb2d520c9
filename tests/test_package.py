"""The package as users install it: a wheel built and installed where no C compiler works.

The wheel is built from a copy of the checkout with `CC=false` and a PATH without any
compiler, and installed into a fresh venv. That venv sees the frameworks of the suite's
own environment through a path entry (not its `.pth` files, so not its editable
keras_dist): what is tested is keras_dist's own install, not PyPI's downloads. A two-line
script then trains under `keras-dist launch -n 2` on JAX and PyTorch, and a local
MultiWorkerMirrored cluster trains too, saying in one line that its servers listen on all
interfaces (the loopback library needs the compiler).
"""

import shutil
import site
import subprocess
import sys
import zipfile

import pytest

from runner import PYTHON, QUIET_ENV, ROOT

pytestmark = pytest.mark.timeout(600)

SCRIPT = """
import keras
import numpy as np
import keras_dist

x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer="sgd", loss="mse")
history = model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0)
print("trained", keras_dist.__file__, history.history["loss"][-1])
"""


@pytest.fixture(scope="module")
def venv_without_compiler(tmp_path_factory):
    """A fresh venv with keras_dist installed from a wheel built with no compiler."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.so", "__pycache__",
                                                                  "*.egg-info", ".cache"))
    no_compiler = tmp / "bin"  # nothing but Python on PATH
    no_compiler.mkdir()
    (no_compiler / "python3").symlink_to(PYTHON)
    env = {"PATH": str(no_compiler), "CC": "false", "CXX": "false", "HOME": str(tmp)}
    built = subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist",
                            source], env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel, = (tmp / "dist").glob("keras_dist-*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    venv = tmp / "venv"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    installed = subprocess.run([PYTHON, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps",
                                "--no-index", wheel], env=env, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    site_packages, = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "frameworks.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (tmp / "train.py").write_text(SCRIPT)
    return venv, site_packages, tmp / "train.py"


@pytest.mark.parametrize("keras_backend, launch", [
    ("jax", []),
    ("torch", []),
    ("tensorflow", ["--backend", "multi_worker_mirrored"]),
])
def test_a_wheel_built_without_a_compiler_installs_and_trains_under_keras_dist_launch(venv_without_compiler,
                                                                                      keras_backend, launch):
    venv, site_packages, script = venv_without_compiler
    pytest.importorskip(keras_backend)
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", **QUIET_ENV, "KERAS_BACKEND": keras_backend}
    done = subprocess.run([venv / "bin" / "keras-dist", "launch", *launch, "-n", "2", script], env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    trained = [line for line in out.splitlines() if "trained " in line]
    assert len(trained) == 2 and all(str(site_packages) in line for line in trained), out[-3000:]
    losses = {line.rsplit(" ", 1)[1] for line in trained}
    assert len(losses) == 1, trained  # every rank logs the same global loss
    unbound = [line for line in out.splitlines() if "_bind_address.so is not installed" in line]
    assert len(unbound) == (1 if keras_backend in ("tensorflow", "torch") else 0), out[-3000:]
