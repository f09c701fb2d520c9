"""Machine 0's directory (`keras_dist.launchers.nodes`) answers bad input with a 4xx or a
closed connection, prints no traceback, and keeps serving (issue 55, item 2). A real
server on 127.0.0.1, raw sockets, no mocks."""

import json
import random
import socket
import time

import pytest


@pytest.fixture
def served(monkeypatch):
    from keras_dist.launchers import nodes
    from keras_dist.launchers.processes import free_ports

    monkeypatch.setattr(nodes, "REQUEST_SECONDS", 1.0)  # the slow client's test waits this long
    master = nodes.Nodes.parse(2, 0, f"127.0.0.1:{free_ports(1)[0]}")
    server = nodes._serve_directory(master)
    try:
        yield master
    finally:
        server.shutdown()
        server.server_close()


def _send(port: int, data: bytes, seconds: float = 5.0) -> bytes:
    """The status line the server answers `data` with, or b"" when it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)  # nothing more comes: a server waiting for more sees the end
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
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
    for i in range(600):
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
