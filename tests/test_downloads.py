"""The script's `keras.utils.get_file` under 2 processes of one machine (keras_dist.downloads):
one download per file, from a local HTTP server that sends slowly enough for the processes to
meet inside it; every process reads the finished files; a failed download stops the other
process in one line instead of a second try."""

import http.server
import io
import json
import tarfile
import threading
import time

import pytest

from runner import WORKERS, configuration_command, run

pytestmark = pytest.mark.timeout(300)
VALUES = "".join(f"{i},{i * i}\n" for i in range(20000))  # about 200 KB, sent in 4 KB pieces


def archive() -> bytes:
    data = VALUES.encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        member = tarfile.TarInfo("archive/values.csv")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def server():
    files = {"/archive.tar.gz": archive(), "/plain.txt": VALUES.encode()}
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            requests.append(self.path)
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for start in range(0, len(body), 4096):
                self.wfile.write(body[start:start + 4096])
                time.sleep(0.01)  # slow enough that both processes are inside get_file together

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_every_file_is_downloaded_once_per_machine(tmp_path, server):
    url, requests = server
    code, output = run(configuration_command("launch_2", [WORKERS / "downloads.py", tmp_path, url]), timeout=240,
                       env={"KERAS_BACKEND": "jax"})
    assert code == 0, output[-4000:]
    reports = [json.loads((tmp_path / f"report.{rank}.json").read_text()) for rank in range(2)]
    assert sorted(requests) == ["/archive.tar.gz", "/missing.zip", "/plain.txt"], requests
    for report in reports:
        assert report["extracted"] == VALUES and report["plain"] == VALUES
    # One process tried and got Keras's error; the other stopped in one line, without a second try.
    missing = sorted(report["missing"] for report in reports)
    assert missing[0].startswith("Exception: URL fetch failure on ") and "404" in missing[0], missing
    assert missing[1].startswith("KerasDistError: the download of ") and "failed in another process" in missing[1], \
        missing
