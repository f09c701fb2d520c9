"""The package as users install it: a wheel built and installed where no C compiler works.

The wheel is built from a copy of the checkout with `CC=false` and a PATH without any
compiler, and installed into a fresh venv. That venv sees the frameworks of the suite's
own environment through a path entry (not its `.pth` files, so not its editable
keras_dist): what is tested is keras_dist's own install, not PyPI's downloads. A two-line
script then trains under `keras-dist launch -n 2` on JAX and PyTorch, and a local
MultiWorkerMirrored cluster trains too, saying in one line that its servers listen on all
interfaces (the loopback library needs the compiler).

The same wheel carries the Horovod recipe: `keras-dist build-horovod` in that venv installs
the Horovod wheel the suite's own set-up cached, and `keras-dist info` there sees its ops
load. `python -m build` makes the release's sdist and wheel, `twine check --strict` accepts
both, and the sdist installs with no compiler too.
"""

import importlib.util
import json
import os
import shutil
import site
import subprocess
import tarfile
import zipfile
from pathlib import Path

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


def _checkout_and_no_compiler(tmp):
    """A copy of the checkout, and an environment whose PATH holds nothing but Python."""
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.so", "__pycache__",
                                                                  "*.egg-info", ".cache"))
    no_compiler = tmp / "bin"
    no_compiler.mkdir()
    (no_compiler / "python3").symlink_to(PYTHON)
    return source, {"PATH": str(no_compiler), "CC": "false", "CXX": "false", "HOME": str(tmp)}


def _fresh_venv(venv, package, env):
    """A venv with no pip of its own, `package` (a wheel or an sdist) installed into it by the suite's pip.

    It sees the suite's frameworks (and pip and setuptools, to build an sdist) through a path
    entry; pip leaves the suite's editable keras_dist alone ("outside environment").
    """
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    site_packages, = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "frameworks.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run([PYTHON, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps",
                                "--no-index", "--no-build-isolation", package], env=env, capture_output=True,
                               text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    return site_packages


@pytest.fixture(scope="module")
def venv_without_compiler(tmp_path_factory):
    """A fresh venv with keras_dist installed from a wheel built with no compiler."""
    tmp = tmp_path_factory.mktemp("package")
    source, env = _checkout_and_no_compiler(tmp)
    built = subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist",
                            source], env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel, = (tmp / "dist").glob("keras_dist-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # Python only: installs wherever Python runs
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith(".so")]
    assert "keras_dist/horovod_build.sh" in names  # what `keras-dist build-horovod` runs
    site_packages = _fresh_venv(tmp / "venv", wheel, env)
    (tmp / "train.py").write_text(SCRIPT)
    return tmp / "venv", site_packages, tmp / "train.py"


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


def _horovod_cache():
    """Where the suite's set-up (./dev.sh: `keras-dist build-horovod`) cached its Horovod wheel: the recipe's rule."""
    return os.environ.get("KERAS_DIST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "keras_dist")


def test_keras_dist_build_horovod_installs_the_cached_horovod_and_info_sees_its_ops_load(venv_without_compiler):
    venv, site_packages, _ = venv_without_compiler
    cache = _horovod_cache()
    if not list(Path(cache).glob("wheels/horovod-*/horovod-*.whl")):
        pytest.skip(f"no Horovod wheel cached in {cache}: ./dev.sh builds one")
    # HOME is the test's: the cache is named, as on a machine whose cache lives elsewhere.
    env = {**QUIET_ENV, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(venv.parent),
           "KERAS_DIST_CACHE": cache}
    done = subprocess.run([venv / "bin" / "keras-dist", "build-horovod"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "building Horovod" not in done.stderr, "the cached wheel should have been installed, not a new build"
    where = subprocess.run([venv / "bin" / "python", "-c", "import horovod; print(horovod.__file__)"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(site_packages)), where.stdout + where.stderr[-2000:]
    info = subprocess.run([venv / "bin" / "keras-dist", "info"], env={**env, "KERAS_BACKEND": "jax"},
                          capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr[-3000:]
    horovod = json.loads(info.stdout)["horovod"]
    frameworks = ["tensorflow"] + (["torch"] if importlib.util.find_spec("torch") else [])  # the venv's, borrowed
    loaded = [f for f in frameworks if isinstance(horovod.get(f), dict) and horovod[f]["ops"] == "load"]
    assert loaded == frameworks, horovod


def test_horovod_recipe_builds_with_gloo_where_mpi_has_its_runtime_but_no_headers():
    """Debian's openmpi-bin brings mpicxx without mpi.h: Horovod's cmake then failed after a
    minute and a half with a 40-line pip traceback (`./dev.sh train`, issue 67). The recipe
    compiles a small MPI program first and builds with Gloo where it does not compile, saying
    why in one line; the wheel keeps the name a build without MPI had, so the cached one serves."""
    from hostbed import install_debian_package

    install_debian_package("openmpi-bin", "/usr/bin/mpirun")
    recipe = ROOT / "keras_dist" / "horovod_build.sh"
    choice = subprocess.run(["bash", recipe, "--mpi-check"], capture_output=True, text=True, timeout=120)
    assert choice.returncode == 0, choice.stderr
    headers = subprocess.run(["bash", "-c", "echo '#include <mpi.h>' | mpicxx -x c++ -fsyntax-only -"],
                             capture_output=True).returncode == 0
    if headers:
        assert choice.stdout.strip() == "mpi", choice.stdout
    else:
        (line,) = choice.stdout.strip().splitlines()
        assert line.startswith("gloo: /usr/bin/mpicxx cannot build an MPI program (fatal error: mpi.h"), line
        assert "apt-get install -y libopenmpi-dev" in line, line


def test_keras_dist_build_horovod_without_a_compiler_says_what_to_install(venv_without_compiler):
    venv, _, _ = venv_without_compiler
    done = subprocess.run([venv / "bin" / "keras-dist", "build-horovod"],
                          env={"PATH": str(venv / "bin"), "HOME": str(venv.parent)},
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "needs gcc, g++, cmake" in lines[0] and "apt-get install -y gcc g++ cmake" in lines[0], lines


# What `pip install` of the sdist needs to build the wheel, and the files a release must carry.
SDIST_FILES = ["setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE", "keras_dist/bind_address.c",
               "keras_dist/horovod_build.sh"]


def test_python_m_build_makes_an_sdist_and_wheel_that_twine_accepts_and_the_sdist_installs_without_a_compiler(
        tmp_path):
    source, no_compiler = _checkout_and_no_compiler(tmp_path)
    # --no-isolation: the suite's setuptools, not one downloaded into an isolated environment.
    built = subprocess.run([PYTHON, "-m", "build", "--no-isolation", "--outdir", tmp_path / "dist", source],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    sdist, = (tmp_path / "dist").glob("keras_dist-*.tar.gz")
    wheel, = (tmp_path / "dist").glob("keras_dist-*.whl")
    top = sdist.name.removesuffix(".tar.gz")
    in_sdist = tarfile.open(sdist).getnames()
    assert not [f for f in SDIST_FILES if f"{top}/{f}" not in in_sdist], in_sdist
    in_wheel = zipfile.ZipFile(wheel).namelist()
    # Built where a compiler works: with the loopback library, for this platform and Python.
    assert "keras_dist/_bind_address.so" in in_wheel and "-linux_" in wheel.name, wheel.name
    assert "keras_dist/horovod_build.sh" in in_wheel and f"{top}.dist-info/licenses/LICENSE" in in_wheel, in_wheel
    metadata = zipfile.ZipFile(wheel).read(f"{top}.dist-info/METADATA").decode()
    for field in ("License-File: LICENSE", "Classifier: License :: OSI Approved :: Apache Software License",
                  "Classifier: Programming Language :: Python :: 3.11", "Requires-Python: >=3.10",
                  "Description-Content-Type: text/markdown"):
        assert field in metadata, field
    checked = subprocess.run([PYTHON, "-m", "twine", "check", "--strict", sdist, wheel], capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr
    site_packages = _fresh_venv(tmp_path / "venv", sdist, no_compiler)
    imported = subprocess.run([tmp_path / "venv" / "bin" / "python", "-c",
                               "import keras_dist, keras_dist.cli; print(keras_dist.__file__)"],
                              env={**QUIET_ENV, "KERAS_BACKEND": "jax", "HOME": str(tmp_path)}, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
    assert imported.returncode == 0 and imported.stdout.startswith(str(site_packages)), imported.stderr[-3000:]
