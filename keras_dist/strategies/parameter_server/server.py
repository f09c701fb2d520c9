"""What a parameter-server job's worker and ps tasks run: a TensorFlow server that ends with the job.

A TensorFlow server serves until it is killed. On one machine `keras-dist launch` kills
it; on several machines nobody does, so each server here watches the chief instead and
exits a few seconds after it is gone: 0 when the chief ended the job cleanly (it leaves
a note in each server's temporary directory as it exits, `announce_end`), 1 when it
failed, was killed, or its machine became unreachable.
"""

import atexit
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

import tensorflow as tf

from keras_dist import console, network
from keras_dist.errors import KerasDistError
from keras_dist.environments import parse_tf_config

SERVING_TASKS = ("worker", "ps")
logger = logging.getLogger("keras_dist")

# Seconds the chief's port must stay closed before a server stops (a chief restarting its
# own server, or a lost packet, is not the end of the job).
CHIEF_GONE_SECONDS = 5.0
# Seconds a server waits for the chief to appear at all: a chief that never starts (a
# typo in its command, a machine that never came up) must not leave servers up for ever.
CHIEF_START_SECONDS = 900.0


def ps_cluster(environ: Mapping[str, str]) -> tuple[dict[str, list[str]], str, int]:
    """`(cluster, task_type, index)` of a TF_CONFIG that lists ps tasks, with one-line errors."""
    cluster, kind, index = parse_tf_config(environ.get("TF_CONFIG", ""))
    if not cluster.get("ps") or not cluster.get("worker"):
        raise KerasDistError("backend 'parameter_server' needs TF_CONFIG with 'ps' and 'worker' tasks; "
                             "launch with `keras-dist launch --backend parameter_server -n WORKERS --ps K`")
    if kind not in ("chief", *SERVING_TASKS):
        raise KerasDistError(f"backend 'parameter_server' has no {kind!r} task; run evaluation on the chief "
                             "(validation_data) and drop it from TF_CONFIG")
    if len(cluster.get("chief", [])) != 1:
        raise KerasDistError("backend 'parameter_server' needs exactly one 'chief' task in TF_CONFIG: "
                             "it runs the script and schedules the steps")
    return cluster, kind, index


def serve(cluster: dict, kind: str, index: int) -> int:
    """Runs this process as TF_CONFIG's `kind:index` server until the chief is gone.

    Args:
        cluster: TF_CONFIG's cluster dict.
        kind: "worker" or "ps".
        index: the task index.

    Returns:
        The exit code for this task: 0 after a clean end of the job, 1 otherwise.
    """
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=kind, task_index=index,
                                  protocol="grpc", start=True)
    # This process runs no script of the user's: keras_dist's warnings are the ones it shows.
    console.configure_logging(is_chief=False)
    logger.info("keras_dist: %s:%d serving at %s for the chief", kind, index, cluster[kind][index])
    note = _end_note(cluster, kind, index)
    _remove(note)  # left by an earlier job on the same ports, whose servers were killed

    def stop(signum, frame):  # a launcher ending the job removes the note it may have got
        _remove(note)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    code = _wait_for_the_chief(cluster["chief"][0], note)
    del server  # referenced until here: a collected server stops serving
    return code


def _wait_for_the_chief(chief: str, note: str) -> int:
    seen, gone_since, started = False, None, time.monotonic()
    while True:
        if network.answers(chief):
            seen, gone_since = True, None
        elif not seen:
            if time.monotonic() - started > CHIEF_START_SECONDS:
                logger.error("keras_dist: the chief at %s never answered in %g s; this task stops", chief,
                             CHIEF_START_SECONDS)
                return 1
        else:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since >= CHIEF_GONE_SECONDS:
                break
        time.sleep(1.0)
    if _remove(note):
        return 0
    logger.error("keras_dist: the chief at %s is gone without ending the job (it failed, or its machine is "
                 "unreachable); this task stops", chief)
    return 1


def _remove(path: str) -> bool:
    """Removes `path`; whether it was there."""
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False


def _end_note(cluster: dict, kind: str, index: int) -> str:
    """The file by which the chief tells server `kind:index` of this job that the job ended cleanly.

    Named by the cluster's ports, which every task sees alike (a task may rename its own
    host by its address, see `keras_dist.strategies.tf_server`).
    """
    ports = {name: [address.rpartition(":")[2] for address in tasks] for name, tasks in cluster.items()}
    job = hashlib.sha256(json.dumps(ports, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"keras_dist-{job}-{kind}-{index}.ended")


def announce_end(cluster: dict, stalled: threading.Event) -> None:
    """At the chief's exit: a note to every server after a clean end; a prompt exit after a stall.

    Registered by the chief's strategy. After an uncaught exception (Python keeps it in
    `sys.last_value`) no note is written, so the servers exit 1. After a step stalled
    on a frozen worker, TensorFlow's teardown would wait for that step for ever: the
    chief exits 1 here instead.
    """

    def at_exit():
        if stalled.is_set():
            logger.error("keras_dist: a step stalled; exiting without waiting for it")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if getattr(sys, "last_value", None) is not None:
            return
        for kind in SERVING_TASKS:
            for index in range(len(cluster[kind])):
                note = _end_note(cluster, kind, index)
                # On the server's device: the note lands on its machine. Bounded, as a
                # lost server must not hold up the chief's exit.
                writer = threading.Thread(target=_write_on, args=(f"/job:{kind}/replica:0/task:{index}", note),
                                          daemon=True)
                writer.start()
                writer.join(5.0)

    atexit.register(at_exit)


def _write_on(device: str, path: str) -> None:
    try:
        with tf.device(f"{device}/device:CPU:0"):
            tf.io.write_file(path, "")
    except Exception:  # a lost server: it exits 1 by itself, as it should
        logger.debug("no end note for %s", device, exc_info=True)
