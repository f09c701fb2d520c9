"""The script's own saves in a job of several processes: written once, by the chief, atomically.

A script ends with `model.save(p)` (or `save_weights`, or `export`) and often reads it
back at once with `keras.models.load_model(p)`. Every process runs the script, so every
process would write `p` at the same moment: the file came out corrupt (a bad CRC in
`config.json`) and the next `load_model` failed. For a model `keras_dist.compile`
compiled, those three methods are replaced on the model object (`install`):

* the chief writes into a staging directory beside `p`, then renames what Keras wrote
  into place (shards first, the named file last): a reader sees the previous file or the
  new one, never part of one. It then records on `p` itself, in an extended attribute
  (`user.keras_dist.saved`), how many of its saves of `p` are committed and when, and goes
  on: it waits for nobody, so a save called by the chief alone
  (`if keras_dist.current().is_chief:`) costs what it did. Only where the file system keeps
  no extended attributes does the record go in a file beside `p`, `.keras_dist-saved-NAME`.
* every other process writes nothing: its k-th save of `p` returns once that record says
  k or more (from this run: records older than this process are a run before's). Its next
  line may read `p`. Where the machines share no file system, the record never appears:
  after the wait bound (the step timeout's first value, longer while the chief's staging
  directory still grows) one line says so and names the fix.

On JAX the chief saves on its own copy of the weights (`CheckpointIO.saving`):
under Keras's multi-process distribution each variable Keras makes while saving is a
collective, which hung a chief saving alone. Paths Keras writes elsewhere than the local
file system (`gs://`, `hf://`) and file objects are the chief's alone, with no wait.
`keras.saving.save_model(model, p)`, Keras's function, does not go through the model's
methods, so it writes from every process that calls it; `docs/semantics.md` says so.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras

from keras_dist.errors import KerasDistError
from keras_dist.fault_tolerance.atomic_writes import PARTIAL_PREFIX, SAVING_METHODS, publish
from keras_dist.overrides import override

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas

RECORD_ATTRIBUTE = "user.keras_dist.saved"
RECORD_PREFIX = ".keras_dist-saved-"  # where the file system keeps no extended attributes
_POLL_SECONDS = 0.05
# When this process started keras_dist's part: a record older than that is a run before's.
_STARTED = time.time()
# A record's time comes from the chief's clock, which may lag ours a little.
_CLOCK_SLACK_SECONDS = 1.0


def install(model: keras.Model, replicas: "Replicas") -> None:
    """Makes `model.save`, `save_weights` and `export` write once, from the chief (a job of
    several processes; one process keeps Keras's own methods)."""
    if replicas.size == 1:
        return
    for name in SAVING_METHODS:
        keras_method = getattr(type(model), name, None)
        if keras_method is not None:
            override(model, name, _once_from_the_chief(model, replicas, keras_method.__get__(model)))


def _once_from_the_chief(model: keras.Model, replicas: "Replicas", keras_method: Callable[..., Any]) -> Callable[..., Any]:
    def save(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(filepath, (str, os.PathLike)):  # a file object: this process's own
            with replicas.checkpoint_io.saving(model):
                return keras_method(filepath, *args, **kwargs)
        if "://" in os.fspath(filepath):  # Keras writes it through its own file layer: the chief's alone
            if not replicas.is_chief:
                return None
            with replicas.checkpoint_io.saving(model):
                return keras_method(filepath, *args, **kwargs)
        path = os.path.abspath(os.fspath(filepath))

        def write() -> Any:
            with replicas.checkpoint_io.saving(model):
                return _write_committed(path, keras_method, args, kwargs)

        return written_once(replicas, path, CommitRecord.on_file(path), write, elsewhere=None)

    return save


# This process's saves so far, by series (a file's absolute path, or a directory and name).
_SAVES: dict[str, int] = {}


def written_once(replicas: "Replicas", series: str, record: "CommitRecord", write: Callable[[], Any],
                 elsewhere: Any) -> Any:
    """One save that every process makes, written by the chief alone: the chief runs `write`
    and records in `record` how many saves of `series` it has committed; every other
    process waits for that count (its own saves of `series` so far), then returns
    `elsewhere`, writing nothing."""
    _SAVES[series] = count = _SAVES.get(series, 0) + 1
    if not replicas.is_chief:
        _wait_for_chief(record, count, replicas)
        return elsewhere
    result = write()
    _record_commit(record, count)
    return result


def _write_committed(path: str, keras_method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Runs `keras_method` on a staging path beside `path`, then renames what it wrote into place."""
    directory, name = os.path.split(path)
    if not os.path.isdir(directory) or _asks_before_overwriting(path, args, kwargs):
        return keras_method(path, *args, **kwargs)  # Keras's own error, or its question, as without keras_dist
    staging = os.path.join(directory, f"{PARTIAL_PREFIX}{name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)  # left by a chief killed while saving
    os.mkdir(staging)
    try:
        result = keras_method(os.path.join(staging, name), *args, **kwargs)
        # Shards before the file that names them; a directory (a SavedModel) whole.
        for entry in sorted(os.listdir(staging), key=lambda e: e == name):
            _move_into_place(os.path.join(staging, entry), os.path.join(directory, entry))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _asks_before_overwriting(path: str, args: tuple, kwargs: dict) -> bool:
    """`overwrite=False` over an existing file: Keras asks the user, on the real name."""
    overwrite = kwargs.get("overwrite", args[0] if args and isinstance(args[0], bool) else True)
    return not overwrite and os.path.exists(path)


def _move_into_place(source: str, target: str) -> None:
    if not os.path.isdir(source):
        publish(source, target)
        return
    # A directory cannot replace a non-empty one in one rename: the old one moves aside first.
    aside = f"{source}.previous"
    if os.path.exists(target):
        os.replace(target, aside)
    os.replace(source, target)
    shutil.rmtree(aside, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """Where the chief records how many saves of one thing it has committed.

    Args:
        saved: the path the script saves (for messages, and the chief's staging beside it).
        holder: the file or directory whose extended attribute `attribute` holds the record.
        fallback: the file that holds it where the file system keeps no extended attributes.
    """

    saved: str
    holder: str
    attribute: str
    fallback: str

    @classmethod
    def on_file(cls, path: str) -> "CommitRecord":
        """The record of the saves of `path`, on `path` itself."""
        directory, name = os.path.split(path)
        return cls(path, path, RECORD_ATTRIBUTE, os.path.join(directory, RECORD_PREFIX + name))

    @classmethod
    def in_directory(cls, saved: str, directory: str, series: str) -> "CommitRecord":
        """The record of a series of saves into `directory` (files the chief may delete later,
        as a checkpoint manager does), on `directory`."""
        return cls(saved, directory, f"{RECORD_ATTRIBUTE}.{series}", os.path.join(directory, RECORD_PREFIX + series))


def _record_commit(record: CommitRecord, count: int) -> None:
    """Says, in `record`, that the chief's first `count` saves are committed."""
    value = json.dumps({"committed": count, "at": time.time()}).encode()
    try:
        os.setxattr(record.holder, record.attribute, value)
        return
    except (OSError, AttributeError):  # no extended attributes here (or no os.setxattr: not Linux)
        pass
    partial = f"{record.fallback}.{os.getpid()}"
    with open(partial, "wb") as f:
        f.write(value)
    publish(partial, record.fallback)


def _committed(record: CommitRecord) -> int:
    """The saves the chief committed in this run (0: none yet, or a record of a run before)."""
    for read in (lambda: os.getxattr(record.holder, record.attribute), lambda: _read_bytes(record.fallback)):
        with contextlib.suppress(OSError, ValueError, KeyError, AttributeError):
            value = json.loads(read())
            if value["at"] >= _STARTED - _CLOCK_SLACK_SECONDS:
                return int(value["committed"])
    return 0


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _staging_size(path: str) -> int:
    """Bytes in the chief's staging directories for `path` so far: its save's progress."""
    directory, name = os.path.split(path)
    total = 0
    with contextlib.suppress(OSError):  # renamed into place or removed meanwhile
        for staging in os.listdir(directory):
            if staging.startswith(f"{PARTIAL_PREFIX}{name}."):
                for root, _, files in os.walk(os.path.join(directory, staging)):
                    total += sum(os.path.getsize(os.path.join(root, file)) for file in files)
    return total


def _wait_for_chief(record: CommitRecord, count: int, replicas: "Replicas") -> None:
    """Returns once the chief has committed its `count`-th save (`record`); one line after
    the step timeout's first value without it (or without its save growing on disk)."""
    timeout, rank, path = replicas.step_timeout.first, replicas.rank, record.saved
    deadline, size = time.monotonic() + timeout, _staging_size(path)
    while _committed(record) < count:
        now = time.monotonic()
        if now > deadline:
            grown = _staging_size(path)
            if grown == size:
                raise KerasDistError(
                    f"rank {rank} saved {path} and waited {timeout:g} s for the chief's copy, which did not appear "
                    "there: the chief did not save it (save on every process, or on the chief alone, not on some), or "
                    "this machine does not share the chief's file system (save to a path every machine shares, or "
                    "save on the chief alone: `if keras_dist.current().is_chief:`)")
            size, deadline = grown, now + timeout
        time.sleep(_POLL_SECONDS)
