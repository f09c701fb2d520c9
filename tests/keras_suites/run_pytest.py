"""`python -m pytest` as a script, for launchers that start a script (keras-dist launch, torchrun)."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(sys.argv[1:]))
