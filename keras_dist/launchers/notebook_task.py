"""One process of `keras_dist.notebook_launcher`: runs the pickled function, keeps the chief's result.

    python notebook_task.py DIRECTORY

Reads DIRECTORY/payload.pkl, runs `function(*args)`; the chief writes its result to
DIRECTORY/result.pkl; a failure writes the error's first line to DIRECTORY/error-RANK.txt
and exits 1 at once (the traceback goes to the output as usual).
"""

import os
import pickle
import sys
import traceback

# The files a task leaves in the launch's directory.
PAYLOAD, RESULT, ERROR = "payload.pkl", "result.pkl", "error-{rank}.txt"


def main(directory: str) -> int:
    from keras_dist import environments

    rank = environments.detect(os.environ).rank
    try:
        with open(os.path.join(directory, PAYLOAD), "rb") as f:
            function, args = pickle.load(f)
        result = function(*args)
    except BaseException as exc:  # every failure, with its rank, for the kernel's exception
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        with open(os.path.join(directory, ERROR.format(rank=rank)), "w") as f:
            f.write(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
        sys.stdout.flush()
        sys.stderr.flush()
        # At once: an orderly exit would wait in the framework's shutdown (JAX's barrier) for
        # peers that wait in a collective for this process; the launcher stops them.
        os._exit(1)
    if rank == 0:
        with open(os.path.join(directory, RESULT), "wb") as f:
            pickle.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
