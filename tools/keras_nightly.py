"""keras_dist's smoke subset against keras-nightly, in a scratch venv; prints a one-screen report.

    .venv/bin/python tools/keras_nightly.py [--keras keras-nightly] [--tests FILE[::NAME] ...]

`--keras` takes any pip requirement for Keras, e.g. `--keras keras==3.11.0` to try the
oldest release setup.cfg allows. The scratch venv (`$KERAS_DIST_CACHE/keras-nightly`, or
`keras-3.11.0` for that spec; default cache ~/.cache/keras_dist) gets only
the Keras to try (`pip install --pre --no-deps SPEC`); the frameworks, pytest and keras_dist
itself come from the environment running this script through a path file, so what the
report shows is the change in Keras alone. The subset (a few minutes on 2 cores): every
input structure on the three backends (tests/test_input_matrix.py), the one-process API
(tests/test_api.py), and one-process kills and resumes (tests/test_resume.py), which lean
on Keras's private saving walk and trainer internals. `KERAS_DIST_KERAS_NIGHTLY=1 .ci/run`
runs it after the suite. Exit status: pytest's.
"""

import argparse
import os
import re
import site
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBSET = ["tests/test_input_matrix.py", "tests/test_api.py", "tests/test_resume.py::test_one_process_killed_at_any_step_resumes_exactly"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras", "--spec", dest="spec", default="keras-nightly",
                        help="what pip installs as Keras (default keras-nightly), e.g. keras==3.11.0")
    parser.add_argument("--tests", nargs="*", default=SUBSET)
    args = parser.parse_args()
    cache = Path(os.environ.get("KERAS_DIST_CACHE") or Path.home() / ".cache" / "keras_dist")
    # One venv per spec: `keras` and `keras-nightly` are two distributions of one package.
    venv = cache / re.sub(r"[^A-Za-z0-9.]+", "-", args.spec.replace("==", "-")).strip("-")
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    started = time.time()
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--pre", "--no-deps", "--upgrade",
                    args.spec], check=True)
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    # keras_dist from this checkout, then this environment's packages (its own Keras shadowed).
    (site_packages / "keras_dist_environment.pth").write_text("\n".join([str(ROOT), *site.getsitepackages()]) + "\n")
    # The tests run these commands beside their Python: keras_dist's, and Horovod's launcher.
    for name, module, function in (("keras-dist", "keras_dist.cli", "main"),
                                   ("horovodrun", "horovod.runner.launch", "run_commandline")):
        console = venv / "bin" / name
        # Guarded as pip writes them: horovodrun's spawned helpers import it again.
        console.write_text(f"#!{python}\nimport sys\nfrom {module} import {function}\n"
                           f"if __name__ == '__main__':\n    sys.exit({function}())\n")
        console.chmod(0o755)
    version = subprocess.run([python, "-c", "import keras; print(keras.__version__, keras.__file__)"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert str(site_packages) in version[1], f"the scratch venv imports Keras from {version[1]}"
    done = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "--durations=0", *args.tests],
                          cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), "no summary")
    print(f"keras_dist against Keras {version[0]} ({args.spec}), {time.time() - started:.0f} s")
    print(f"tests: {' '.join(args.tests)}")
    print(f"result: {summary.strip('= ')}")
    for line in failures[:20]:
        print(f"  {line[:160]}")
    if done.returncode and not failures:
        print(done.stdout[-2000:] + done.stderr[-2000:])
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
