"""Machine 0's directory (`keras_dist.launchers.nodes`) admits the job's machines only, by
the job's secret (issue 55, item 1), answers bad input with a 4xx or a closed connection,
prints no traceback, and keeps serving (item 2). A real server on 127.0.0.1, raw sockets,
real `keras-dist launch` processes, no mocks."""

import dataclasses
import errno
import json
import logging
import os
import random
import secrets
import socket
import subprocess
import time
from pathlib import Path

import pytest

from keras_dist.errors import KerasDistError
from keras_dist.launchers import nodes
from keras_dist.launchers.processes import free_ports, kill_process_groups
from runner import BIN, JOB_SECRET, QUIET_ENV

SECRET = JOB_SECRET.encode()


def machine(rank: int, port: int, secret: bytes | None = SECRET) -> nodes.Nodes:
    """Machine `rank` of a job of 2 whose master is 127.0.0.1:`port`, with `secret`."""
    return dataclasses.replace(nodes.Nodes.parse(2, rank, f"127.0.0.1:{port}"), secret=secret)


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(nodes, "REQUEST_SECONDS", 1.0)  # the slow client's test waits this long
    master = machine(0, free_ports(1)[0])
    server = nodes._serve_directory(master)
    try:
        yield master
    finally:
        server.shutdown()
        server.server_close()


def _send(port: int, data: bytes, seconds: float = 5.0, source: str = "127.0.0.1") -> bytes:
    """The status line the server answers `data` with, or b"" when it closed the connection
    (or reset it: it answers a body over the limit, 413, without reading it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds, source_address=(source, 0)) as sock:
        reply = b""
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # nothing more comes: a server waiting for more sees the end
            while b"\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except OSError as exc:
            if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                raise
        return reply.split(b"\r\n", 1)[0]


def _status(line: bytes) -> int | None:
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _good_round_trip(master) -> None:
    master._publish("3", {"address": "127.0.0.1"})
    assert master._read("3") == {"0": {"address": "127.0.0.1"}}


MALFORMED = {
    "PUT without Content-Length": b"PUT /3/1 HTTP/1.1\r\nHost: x\r\n\r\n{}",
    "PUT with a huge Content-Length": b"PUT /3/1 HTTP/1.1\r\nContent-Length: 99999999999999\r\n\r\n{}",
    "PUT with a negative Content-Length": b"PUT /3/1 HTTP/1.1\r\nContent-Length: -1\r\n\r\n{}",
    "PUT with a body over 64 KiB": b"PUT /3/1 HTTP/1.1\r\nContent-Length: 70000\r\n\r\n" + b"1" * 70000,
    "PUT of a body not JSON": b"PUT /3/1 HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope",
    "PUT of a body not UTF-8": b"PUT /3/1 HTTP/1.1\r\nContent-Length: 2\r\n\r\n\xff\xfe",
    "PUT of JSON nested too deep": b"PUT /3/1 HTTP/1.1\r\nContent-Length: 60000\r\n\r\n" + b"[" * 60000,
    "PUT without a rank": b"PUT /3 HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "PUT with a rank not a number": b"PUT /3/x HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "GET of an unknown path": b"GET /3/1/../../etc/passwd HTTP/1.1\r\n\r\n",
    "POST": b"POST /3/1 HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "DELETE": b"DELETE /3 HTTP/1.1\r\n\r\n",
    "an unknown method": b"BREW /3 HTTP/1.1\r\n\r\n",
    "a garbage request line": b"\x00\x01garbage\xff\r\n\r\n",
    "a request line too long": b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_request_gets_a_4xx_and_no_traceback(served, capfd, name):
    started = time.monotonic()
    status = _status(_send(served.port, MALFORMED[name]))
    assert status is None or 400 <= status < 500, (name, status)
    assert time.monotonic() - started < 5
    _good_round_trip(served)
    assert "Traceback" not in capfd.readouterr().err


def test_a_malformed_request_does_not_change_what_get_returns(served):
    _good_round_trip(served)
    for name in ("PUT of a body not JSON", "PUT with a body over 64 KiB", "PUT without Content-Length"):
        _send(served.port, MALFORMED[name])
    assert served._read("3") == {"0": {"address": "127.0.0.1"}}


def test_a_slow_client_that_never_finishes_its_body_is_closed_and_others_are_served(served, capfd):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(b"PUT /3/1 HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        _good_round_trip(served)  # served meanwhile, on another thread
        assert sock.recv(4096) == b""  # closed once REQUEST_SECONDS passed
    assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(b"GET /3 HT")  # a request line never finished
        assert sock.recv(4096) == b""
    assert time.monotonic() - started < 8
    _good_round_trip(served)
    assert "Traceback" not in capfd.readouterr().err


def test_fuzz_random_requests_leave_the_directory_serving_without_a_traceback(served, capfd):
    """Seeded: random byte strings, random request lines, and valid heads with random
    bodies; every answer is a 4xx, a 200 to a well-formed request, or a closed connection."""
    rng = random.Random(55)
    methods = [b"GET", b"PUT", b"POST", b"HEAD", b"DELETE", b"OPTIONS", b"\x00", b"G\xffT", b""]
    paths = [b"/", b"/3", b"/3/1", b"/3/x", b"/../../", b"/%00", b"*", b"http://x/3", b"/" + b"a" * 300]
    counts = {}
    for i in range(1000):
        kind = i % 3
        if kind == 0:
            data = rng.randbytes(rng.randint(0, 300))
        elif kind == 1:
            data = b"%s %s %s\r\n\r\n" % (rng.choice(methods), rng.choice(paths),
                                          rng.choice([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b"", b"x"]))
        else:
            body = rng.randbytes(rng.randint(0, 200))
            length = rng.choice([str(len(body)).encode(), b"", b"-5", b"1e9", b"abc", str(len(body) + 10).encode()])
            data = b"PUT /fuzz/%d HTTP/1.1\r\nContent-Length: %s\r\n\r\n%s" % (rng.randint(0, 9), length, body)
        status = _status(_send(served.port, data))
        counts[status] = counts.get(status, 0) + 1
        assert status is None or status == 200 or 400 <= status < 500, (data[:80], status)
    _good_round_trip(served)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err
    print("fuzz answers by status:", dict(sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))))
    assert served._read("3") == {"0": {"address": "127.0.0.1"}}
    json.dumps(served._read("fuzz"))  # what fuzzing stored is still JSON to every reader


def _signed(method: str, path: str, body: bytes = b"", secret: bytes = SECRET, stamp: int | None = None) -> bytes:
    """A request as a machine of the job sends it (signed with `secret`, made at `stamp`), as
    whoever captured it on the network would replay it."""
    stamp, nonce = str(int(time.time()) if stamp is None else stamp), secrets.token_hex(16)
    mac = nodes._signature(secret, method, path, stamp, nonce, body)
    return (f"{method} {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n{nodes.TIME_HEADER}: {stamp}\r\n"
            f"{nodes.NONCE_HEADER}: {nonce}\r\n{nodes.MAC_HEADER}: {mac}\r\n\r\n").encode() + body


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "keras_dist" and "refused a request" in r.getMessage()]


def test_an_outsider_cannot_register_overwrite_or_read_without_the_secret_and_is_logged_once(served, caplog, capfd):
    caplog.set_level(logging.WARNING, "keras_dist")
    other = machine(1, served.port)
    other._publish("3", {"address": "127.0.0.2"})
    before = served._read("3")
    assert before == {"1": {"address": "127.0.0.2"}}
    forged = json.dumps({"address": "10.0.0.9"}).encode()
    unsigned = [b"PUT /3/1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(forged), forged),  # overwrite
                b"PUT /3/5 HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(forged), forged),  # register
                b"GET /3 HTTP/1.1\r\n\r\n"]
    wrong = [_signed("PUT", "/3/1", forged, b"a guess"), _signed("PUT", "/3/5", forged, b"a guess"),
             _signed("GET", "/3", secret=b"a guess")]
    # Signed well, but the path or body changed on the way: the signature no longer holds.
    moved = [_signed("PUT", "/3/5", forged).replace(b"/3/5", b"/3/1", 1),
             _signed("PUT", "/3/1", b'{"address": "1.2.3.4"}').replace(b"1.2.3.4", b"6.6.6.6", 1)]
    for data in unsigned + wrong + moved:
        assert _status(_send(served.port, data)) == 403, data[:60]
    for data in unsigned:
        assert _status(_send(served.port, data, source="127.0.0.3")) == 403  # another address
    for outsider in (machine(1, served.port, None), machine(1, served.port, b"a guess")):
        with pytest.raises(KerasDistError, match="refused this machine's request: set the same KERAS_DIST_JOB_SECRET"):
            outsider.exchange({"address": "10.0.0.9"})  # at once, not after the join's wait
    assert served._read("3") == before
    assert served._read("elastic-0") == {}
    refusals = _refusals(caplog)
    assert refusals == ["keras_dist: refused a request from 127.0.0.1 without the job's secret (1 so far); every "
                        "machine of the job needs the same KERAS_DIST_JOB_SECRET",
                        "keras_dist: refused a request from 127.0.0.3 without the job's secret (9 so far); every "
                        "machine of the job needs the same KERAS_DIST_JOB_SECRET"], refusals
    assert "Traceback" not in capfd.readouterr().err


def test_a_captured_request_replayed_is_refused_after_its_use_and_after_the_window(served, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "keras_dist")
    monkeypatch.setattr(nodes, "WINDOW_SECONDS", 2.0)
    captured_put = _signed("PUT", "/3/1", b'{"address": "127.0.0.2"}')
    captured_get = _signed("GET", "/3")
    assert _status(_send(served.port, captured_put)) == 200
    assert _status(_send(served.port, captured_get)) == 200
    served._publish("3", {"address": "127.0.0.1"})
    assert _status(_send(served.port, captured_put)) == 403  # replayed while its time is in the window
    assert _status(_send(served.port, captured_get)) == 403
    assert _refusals(caplog) == ["keras_dist: refused a request from 127.0.0.1 replaying one already made (1 so far); "
                                 "every machine of the job needs the same KERAS_DIST_JOB_SECRET"]
    time.sleep(3.1)  # the window is past: its nonce is forgotten, and its time refused
    assert _status(_send(served.port, captured_put)) == 403
    assert _status(_send(served.port, captured_get)) == 403
    for stamp in (time.time() - 10, time.time() + 10):  # signed, but made out of the window
        assert _status(_send(served.port, _signed("PUT", "/3/1", b"{}", stamp=stamp))) == 403
    assert served._read("3") == {"0": {"address": "127.0.0.1"}, "1": {"address": "127.0.0.2"}}
    assert len(_refusals(caplog)) == 1  # one line per address


def test_a_machine_refuses_an_answer_not_signed_with_the_secret():
    stranger = machine(0, free_ports(1)[0], secret=None)  # a directory without the job's secret
    server = nodes._serve_directory(stranger)
    try:
        with pytest.raises(KerasDistError, match="answered without the job's secret"):
            machine(1, stranger.port)._read("3")
    finally:
        server.shutdown()
        server.server_close()


def _launch(rank: int, port: int, script: Path, env: dict) -> subprocess.Popen:
    """`keras-dist launch --nnodes 2` of machine `rank` (TF_CONFIG: its machines meet at the directory)."""
    argv = [BIN / "keras-dist", "launch", "--backend", "multi_worker_mirrored", "-n", "1", "--nnodes", "2",
            "--node-rank", str(rank), "--master-addr", f"127.0.0.1:{port}", script]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_DIST_JOB_SECRET", "TF_CONFIG"))}
    return subprocess.Popen([str(a) for a in argv], env={**base, **QUIET_ENV, "KERAS_BACKEND": "tensorflow", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _descendants(pids: set[int]) -> set[int]:
    """Every live process under `pids`, read from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            pass  # not a process, or gone
    found, grew = set(), True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in pids | found} - found
        found |= new
        grew = bool(new)
    return found


NEEDS_A_SECRET = ("needs a secret", "set KERAS_DIST_JOB_SECRET (", "or KERAS_DIST_JOB_SECRET_FILE (a file of mode 600)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, env, said", [
    (["--nnodes", "2", "--backend", "multi_worker_mirrored"], {}, NEEDS_A_SECRET),
    (["--nnodes", "1:2", "--backend", "torch"], {"KERAS_BACKEND": "torch"}, NEEDS_A_SECRET),
    (["--nnodes", "2", "--backend", "multi_worker_mirrored"], {"KERAS_DIST_JOB_SECRET_FILE": "{open file}"},
     ("KERAS_DIST_JOB_SECRET_FILE=", "may be read by its group or others (mode 644); chmod 600 it")),
], ids=["tf_config", "elastic", "open-file"])
def test_a_multi_machine_launch_without_a_secret_stops_in_one_line_naming_the_variables(tmp_path, args, env, said):
    """Where the job's machines meet at the master's directory (TF_CONFIG, Horovod, elastic jobs)."""
    script = tmp_path / "task.py"
    script.write_text("print('the task ran')\n")
    loose = tmp_path / "secret"
    loose.write_text("s3cret\n")
    loose.chmod(0o644)
    env = {"KERAS_BACKEND": "tensorflow", "KERAS_DIST_JOB_SECRET": "", **env}
    env = {k: str(loose) if v == "{open file}" else v for k, v in env.items()}
    launcher = subprocess.Popen([str(BIN / "keras-dist"), "launch", "-n", "1", *args, "--master-addr",
                                 f"127.0.0.1:{free_ports(1)[0]}", str(script)],
                                env={**os.environ, **QUIET_ENV, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = launcher.communicate(timeout=90)
    finally:
        kill_process_groups([launcher])
    lines = out.strip().splitlines()
    assert launcher.returncode == 2 and len(lines) == 1, out[-2000:]
    assert lines[0].startswith("keras-dist: error: ") and all(part in lines[0] for part in said), lines
    assert "s3cret" not in out and "the task ran" not in out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("insecure", [False, True], ids=["secret", "opted-out"])
def test_a_launch_on_two_machines_meets_with_its_secret_which_shows_in_no_argv_environment_or_output(tmp_path,
                                                                                                    insecure):
    """Two real `keras-dist launch --nnodes 2` (TF_CONFIG) on this machine: machine 0 reads the
    secret from a file of mode 600, machine 1 from the environment; they meet at the
    directory, and no process of the job has the secret in its argv or environment, nor the
    job in its output. Opted out (`KERAS_DIST_INSECURE_DIRECTORY=1`, no secret) they meet
    too, and each launcher says once that it is unsafe."""
    secret = secrets.token_hex(32)
    (tmp_path / "secret").write_text(secret + "\n")
    (tmp_path / "secret").chmod(0o600)
    script = tmp_path / "task.py"
    script.write_text("import json, os, time\n"
                      "print('task', json.loads(os.environ['TF_CONFIG'])['task'], flush=True)\n"
                      "time.sleep(3)\n")
    envs = ([{"KERAS_DIST_INSECURE_DIRECTORY": "1"}] * 2 if insecure else
            [{"KERAS_DIST_JOB_SECRET_FILE": str(tmp_path / "secret")}, {"KERAS_DIST_JOB_SECRET": secret}])
    port = free_ports(1)[0]
    launchers = [_launch(rank, port, script, env) for rank, env in enumerate(envs)]
    seen = {}  # pid -> (argv, environment) of each process of the job
    try:
        deadline = time.monotonic() + 100
        while any(launcher.poll() is None for launcher in launchers):
            assert time.monotonic() < deadline, "the job did not end in 100 s"
            for pid in _descendants({launcher.pid for launcher in launchers}) | {l.pid for l in launchers}:
                try:
                    seen[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/environ").read_bytes())
                except OSError:
                    pass  # gone meanwhile
            time.sleep(0.1)
        outputs = [launcher.communicate(timeout=10)[0] for launcher in launchers]
    finally:
        kill_process_groups(launchers)
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert all(f"'type': 'worker', 'index': {rank}" in out for rank, out in enumerate(outputs)), outputs
    tasks = [argv for argv, _ in seen.values() if str(script).encode() in argv and b"keras-dist" not in argv]
    assert len(tasks) == 2, seen  # the check saw the tasks
    for argv, environment in seen.values():
        assert secret.encode() not in argv
    assert all(secret.encode() not in environment for argv, environment in seen.values() if argv in tasks)
    assert not any(secret in out for out in outputs)
    warned = [out.count("KERAS_DIST_INSECURE_DIRECTORY=1: the master's directory admits anyone") for out in outputs]
    assert warned == ([1, 1] if insecure else [0, 0]), outputs
    assert not any("refused a request" in out or "Traceback" in out for out in outputs), outputs
