"""Keeps a process's TCP listeners on the cluster's address instead of all interfaces.

TensorFlow's gRPC servers (and torch's store) hard-code a wildcard listen address, and
TensorFlow's run whatever graph a client sends, without authentication. The library
`keras_dist/_bind_address.so` (built at install), preloaded, rewrites those wildcard binds
to the address in `KERAS_DIST_BIND_ADDRESS`. A launcher sets both on its tasks up front
(`binding_env`); a TensorFlow task started otherwise restarts itself with them
(`restart_with_binding`, after its strategy asked for them).
"""

import ctypes
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from keras_dist import settings
from keras_dist.errors import KerasDistError

logger = logging.getLogger("keras_dist")

BIND_ALL_VARIABLE = "KERAS_DIST_BIND_ALL"
# Read by the preloaded library (keras_dist/bind_address.c): the address replacing wildcards.
BIND_ADDRESS_VARIABLE = "KERAS_DIST_BIND_ADDRESS"
BIND_LIBRARY = Path(__file__).resolve().parent.parent / "_bind_address.so"


def _active_binding() -> str | None:
    """The address the preloaded library binds to, or None when it is not loaded or inactive."""
    try:
        reader = ctypes.CDLL(None).keras_dist_bind_address
    except AttributeError:
        return None
    reader.restype = ctypes.c_char_p
    value = reader()
    return value.decode() if value else None


def binding_env(environ: Mapping[str, str], address: str) -> dict[str, str]:
    """Variables that make a new process's TCP listeners bind to `address`, not all interfaces.

    A TensorFlow task restarts itself with them (`variables_to_bind`). A launcher that starts a local
    cluster can set them on each task up front, sparing it that restart (and a second
    TensorFlow import). KERAS_DIST_BIND_ALL=1 in the task's environment still wins.

    Args:
        environ: the environment the new process inherits; its LD_PRELOAD entries are kept.
        address: the IPv4 address to listen on, e.g. `"127.0.0.1"`.

    Returns:
        `{"LD_PRELOAD": ..., "KERAS_DIST_BIND_ADDRESS": address}`.

    Where the library is not installed (not Linux, or no C compiler at install), it says
    so in one line, and the process listens on all interfaces.

    Example:

    ```python
    Task("worker:0", argv, env={"TF_CONFIG": config, **binding_env(environ, "127.0.0.1")})
    ```
    """
    if not _binding_library_installed(environ, address):
        return {BIND_ADDRESS_VARIABLE: address}  # tells the task that its launcher said so already
    others = [p for p in _preloaded(environ) if p != str(BIND_LIBRARY)]
    return {"LD_PRELOAD": ":".join([str(BIND_LIBRARY), *others]), BIND_ADDRESS_VARIABLE: address}


_OPT_OUT = f"or set {BIND_ALL_VARIABLE}=1 to let TensorFlow listen on all interfaces"


def _preloaded(environ: Mapping[str, str]) -> list[str]:
    return [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def _binding_library_installed(environ: Mapping[str, str], address: str) -> bool:
    """Whether the library is there; where it is not, says once, in one line, what that leaves open."""
    global _missing_library_said
    if BIND_LIBRARY.exists():
        return True
    if not _missing_library_said and not settings.current().bind_all and environ.get(BIND_ADDRESS_VARIABLE) != address:
        _missing_library_said = True
        logger.warning("keras_dist: %s is not installed (keras_dist was installed without a C compiler, or not on "
                       "Linux), so this job's TensorFlow servers and torch store listen on all interfaces, not on %s "
                       "only; reinstall keras_dist where gcc is present, or set %s=1 to accept that",
                       BIND_LIBRARY.name, address, BIND_ALL_VARIABLE)
    return False


_missing_library_said = False


def variables_to_bind(variables: Mapping[str, str], address: str) -> dict[str, str]:
    """The variables with which this process, restarted, binds its listeners to `address`:
    {} where it does already, or where the library is missing (said in one line).

    `restart_with_binding` restarts it once they are set.

    Raises:
        KerasDistError: the library was preloaded but not loaded, or the process cannot
            restart (an interactive Python).
    """
    global _restart_wanted
    if _active_binding() == address or not _binding_library_installed(variables, address):
        return {}
    if variables.get(BIND_ADDRESS_VARIABLE) == address and str(BIND_LIBRARY) in _preloaded(variables):
        # Set up already (by a launcher or our own restart): the dynamic loader refused the library.
        raise KerasDistError(f"{BIND_LIBRARY} is in LD_PRELOAD but was not loaded (see the loader's message above); {_OPT_OUT}")
    if "RAY_RAYLET_PID" in variables:
        # A Ray worker (a Ray Train worker's actor) cannot start again: its raylet would lose it.
        logger.warning("keras_dist: a Ray worker cannot restart to listen on %s only, so its TensorFlow server "
                       "listens on all interfaces: keep the Ray cluster on a private network (%s=1 says so and "
                       "silences this line)", address, BIND_ALL_VARIABLE)
        return {}
    if sys.argv[0] in ("", "-") or not sys.executable:
        raise KerasDistError(
            f"an interactive Python cannot restart itself to listen on {address} only; start it with "
            f"LD_PRELOAD={BIND_LIBRARY} {BIND_ADDRESS_VARIABLE}={address}, {_OPT_OUT}"
        )
    _restart_wanted = True
    return binding_env(variables, address)


def restart_with_binding() -> None:
    """Restarts this process (same interpreter and command line, `sys.orig_argv`) where
    `variables_to_bind` asked for variables, now set in its environment."""
    if _restart_wanted:
        # Buffered output is dropped, not flushed: the new process prints it again.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ))


# Set by `variables_to_bind` only: a process whose binding is inactive for another reason
# (KERAS_DIST_BIND_ALL=1 turns the library off) must not restart for ever.
_restart_wanted = False
