"""Measured windows shared by the bench workers: whole epochs until a window lasts long enough.

Epoch 0 is warm-up (tracing, compiling, thread pools). From its end, whole epochs
accumulate into a window until it lasts `window` seconds; each window records its
samples, epochs, wall seconds and this process's CPU seconds (`time.process_time`, all
its threads). Processes that train together close their windows at the same epoch, so
that `fit` stops at the same epoch everywhere: rank 0 decides and leaves its decision as
a file in `sync_dir`, the others wait for it (no collective is added to the measured work).
"""

import json
import os
import time


class Windows:
    """Cuts one process's epochs into measured windows."""

    def __init__(self, rank, sync_dir, window, windows):
        self.rank, self.sync_dir, self.window, self.wanted = rank, sync_dir, window, windows
        self.epoch, self.windows = 0, []

    def epoch_end(self, samples):
        """Accounts one finished epoch of `samples`; returns True when the run is over."""
        self.epoch += 1
        if self.epoch == 1:  # warm-up
            self._open()
            return False
        self.samples += samples
        self.epochs += 1
        now, cpu = time.perf_counter(), time.process_time()
        if self._agree(now - self.start >= self.window):
            self.windows.append({"samples": self.samples, "epochs": self.epochs, "seconds": now - self.start,
                                 "cpu_s": cpu - self.cpu})
            self._open()
        return len(self.windows) == self.wanted

    def _open(self):
        self.start, self.cpu, self.samples, self.epochs = time.perf_counter(), time.process_time(), 0, 0

    def _agree(self, close):
        if self.sync_dir is None:
            return close
        path = os.path.join(self.sync_dir, f"epoch-{self.epoch}")
        if self.rank == 0:
            with open(path + ".tmp", "w") as f:
                f.write("1" if close else "0")
            os.replace(path + ".tmp", path)
            return close
        deadline, delay = time.monotonic() + 600, 0.001
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {self.rank}: rank 0 did not finish epoch {self.epoch} within 600 s")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        with open(path) as f:
            return f.read() == "1"

    def report(self, size, params):
        """Prints the `BENCH {json}` line bench/run.py reads."""
        import keras  # already imported by every worker

        print("BENCH " + json.dumps({"rank": self.rank, "size": size, "params": params, "windows": self.windows,
                                     "keras": keras.__version__}), flush=True)
