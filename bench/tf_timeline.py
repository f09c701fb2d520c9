"""Where a TensorFlow training step's time goes, from TensorFlow's profiler (bench/worker.py's
BENCH_TF_PROFILE=DIR): per step, when the backward pass's last op ends, when the gradients'
all-reduces start and end, and how long the core computes.

    .venv/bin/python bench/tf_timeline.py DIR

A step is one call of a traced step function (`__inference_...step...`) on the Python
thread. Within it: `backward_ends` is the end of the last op under `gradient_tape/`;
`all_reduce_starts/ends` the first start and last end of the collective ops
(CollectiveReduce*, each also by name: TensorFlow's packs, then the loss's); `compute` sums
the ops of the executor's threads (overlapping ops counted once); `period` runs to the
next step's start, so a wait between steps (an epoch's end) shows in its mean and max.
Medians, means and maxima over steps.
"""

import statistics
import sys
from pathlib import Path

from tensorflow.tsl.profiler.protobuf import xplane_pb2

COLLECTIVE = ("CollectiveReduce", "CollectiveGather", "CollectiveBcast")


def _union(intervals):
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def steps_of(path: Path) -> list[dict]:
    space = xplane_pb2.XSpace()
    space.ParseFromString(path.read_bytes())
    host = next(plane for plane in space.planes if plane.name == "/host:CPU")
    names = {key: meta.name for key, meta in host.event_metadata.items()}
    events = []  # (start ns, end ns, name, thread)
    for line in host.lines:
        for event in line.events:
            start = line.timestamp_ns + event.offset_ps / 1000
            events.append((start, start + event.duration_ps / 1000, names.get(event.metadata_id, ""), line.name))
    calls = sorted(e for e in events if e[3] == "python" and e[2].startswith("EagerLocalExecute: __inference_")
                   and "step" in e[2])
    # The outermost call per step: drop calls inside another.
    steps, last_end = [], 0
    for start, end, name, _ in calls:
        if start >= last_end:
            steps.append((start, end))
            last_end = end
    results = []
    for (start, end), following in zip(steps, [*steps[1:], None]):
        # The executor's op events read "name:Type", on its compute and collective threads.
        ops = [e for e in events if e[0] >= start and e[1] <= end and ":" in e[2] and e[3] != "python"]
        collective = [e for e in ops if e[2].split(":")[-1].startswith(COLLECTIVE)]
        backward = [e for e in ops if not e[2].split(":")[-1].startswith(COLLECTIVE)
                    and "gradient_tape" in e[2]]
        compute = [e for e in ops if not e[2].split(":")[-1].startswith(COLLECTIVE)]
        each = {f"{e[2].split(':')[0].removeprefix('StatefulPartitionedCall/')} {what}_ms": (t - start) / 1e6
                for e in collective for what, t in (("starts", e[0]), ("ends", e[1]))}
        results.append({**each,
            "step_ms": (end - start) / 1e6,
            # Start to the next step's start: what happens between steps counts too.
            "period_ms": (following[0] - start) / 1e6 if following else None,
            "backward_ends_ms": (max(e[1] for e in backward) - start) / 1e6 if backward else None,
            "all_reduce_starts_ms": (min(e[0] for e in collective) - start) / 1e6 if collective else None,
            "all_reduce_ends_ms": (max(e[1] for e in collective) - start) / 1e6 if collective else None,
            "compute_ms": _union([(e[0], e[1]) for e in compute]) / 1e6,
        })
    return results


def main(directory: str) -> None:
    for path in sorted(Path(directory).rglob("*.xplane.pb")):
        steps = steps_of(path)
        if not steps:
            print(f"{path}: no steps found")
            continue
        print(f"{path.name}: {len(steps)} steps")
        for key in sorted({key for step in steps for key in step}, key=lambda k: "Collective" in k):
            values = [s[key] for s in steps if s.get(key) is not None]
            if values:
                print(f"  {key}: {statistics.median(values):.1f} (mean {statistics.mean(values):.1f}, "
                      f"max {max(values):.1f})")


if __name__ == "__main__":
    main(sys.argv[1])
