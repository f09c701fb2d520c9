"""`python -m pytest` as a script, for launchers that start a script (keras-dist launch, torchrun).

Its exit is bounded: once pytest has printed its summary, the interpreter's exit handlers
(multiprocessing joins a PyDataset's pool workers there) get `EXIT_SECONDS`; past that every
thread's stack is printed and the process ends with 1, so a hang at exit (seen once on
PyTorch: a forked pool worker blocked on its queue's lock, issue 44) fails its test within a
minute, with the stack that waits, instead of holding the suite until its timeout.
"""

import faulthandler
import sys

import pytest

EXIT_SECONDS = 60

if __name__ == "__main__":
    code = pytest.main(sys.argv[1:])
    faulthandler.dump_traceback_later(EXIT_SECONDS, exit=True)
    sys.exit(code)
