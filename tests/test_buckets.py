"""`keras_dist.strategies.base.buckets` and `bucket_bytes`: the runs of gradients one collective carries.

`buckets` is checked by its documented properties over a seeded sweep of generated
size/dtype lists and limits, then on hand-picked edges, and against DDP's own bucket
assignment where both apply (tensors of one dtype).
"""

import random

import pytest

from keras_dist.settings import Settings
from keras_dist.strategies.base import bucket_bytes, buckets

DTYPES = ["float32", "float16", "bfloat16", "int64"]
CASES = 400


def generated_cases(seed=0):
    """`CASES` (sizes, dtypes, limit, first): few dtypes or many, zero sizes, limits from 0 up."""
    rng = random.Random(seed)
    for _ in range(CASES):
        n = rng.choice([0, 1, 2, 3, rng.randint(4, 40)])
        kinds = DTYPES[:rng.randint(1, len(DTYPES))]
        sizes = [rng.choice([0, 1, 4, rng.randint(1, 64), rng.randint(64, 4096)]) for _ in range(n)]
        dtypes = [rng.choice(kinds) for _ in range(n)]
        limit = rng.choice([0, 1, 16, 64, 256, 1024, 10**6])
        first = rng.choice([None, None, 0, 8, 100, 2048])
        yield sizes, dtypes, limit, first


def check_documented_properties(sizes, dtypes, limit, first):
    """Every property `buckets`' docstring states, for one case."""
    runs = buckets(sizes, dtypes, limit, first)
    case = f"sizes={sizes} dtypes={dtypes} limit={limit} first={first}: {runs}"
    # Every index once, in the order given (the order collectives start), in consecutive runs.
    assert [i for run in runs for i in run] == list(range(len(sizes))), case
    assert all(runs), case
    for k, run in enumerate(runs):
        cap = first if first is not None and k == 0 else limit
        # Runs of one dtype.
        assert len({dtypes[i] for i in run}) == 1, case
        # A run takes tensors while under its limit: the tensor that reaches it joins, none after.
        assert sum(sizes[i] for i in run[:-1]) < cap or len(run) == 1, case
        # A run closes only at its limit or a change of dtype (or the end).
        if k + 1 < len(runs):
            assert sum(sizes[i] for i in run) >= cap or dtypes[runs[k + 1][0]] != dtypes[run[-1]], case
    return runs


def test_buckets_keep_every_documented_property_over_a_seeded_sweep():
    shapes = set()
    for sizes, dtypes, limit, first in generated_cases():
        runs = check_documented_properties(sizes, dtypes, limit, first)
        shapes.add((len(runs) > 1, any(len(run) > 1 for run in runs)))
    # The sweep met both several runs and runs of several tensors, not only trivial cases.
    assert shapes == {(False, False), (False, True), (True, False), (True, True)}


@pytest.mark.parametrize("sizes, dtypes, limit, first, expected", [
    ([], [], 100, None, []),  # no tensors: no runs
    ([], [], 0, 1, []),
    ([10, 10, 10], ["f"] * 3, 0, None, [[0], [1], [2]]),  # 0: every tensor a run
    ([0, 0, 0], ["f"] * 3, 0, None, [[0], [1], [2]]),  # even empty ones
    ([0, 0, 0], ["f"] * 3, 1, None, [[0, 1, 2]]),  # zero-sized tensors never reach a limit
    ([5, 0, 0, 5], ["f"] * 4, 5, None, [[0], [1, 2, 3]]),
    ([1000], ["f"], 10, None, [[0]]),  # one tensor larger than the limit: a run of its own
    ([1000, 1], ["f"] * 2, 10, None, [[0], [1]]),
    ([1, 2, 1000, 1], ["f"] * 4, 10, None, [[0, 1, 2], [3]]),  # the large one goes with those before it
    ([4, 6, 1], ["f"] * 3, 10, None, [[0, 1], [2]]),  # exactly reaching the limit closes the run
    ([4, 5, 1], ["f"] * 3, 10, None, [[0, 1, 2]]),  # one byte under it does not
    ([4, 4, 4], ["f", "h", "f"], 100, None, [[0], [1], [2]]),  # dtypes never mix, even far under the limit
    ([4, 4, 4, 4], ["f", "f", "h", "h"], 100, None, [[0, 1], [2, 3]]),
    ([3, 3, 3, 3, 3], ["f"] * 5, 100, 4, [[0, 1], [2, 3, 4]]),  # `first` bounds the first run only
    ([3, 3, 3, 3, 3], ["f"] * 5, 4, 100, [[0, 1, 2, 3, 4]]),
    ([3, 3, 3, 3], ["f"] * 4, 0, 6, [[0, 1], [2], [3]]),  # limit 0 after a first run of `first`
    ([3, 3, 3], ["f"] * 3, 10, 0, [[0], [1, 2]]),
    ([3, 3, 3], ["h", "f", "f"], 10, 100, [[0], [1, 2]]),  # a dtype change ends the first run early
])
def test_buckets_on_hand_picked_edges(sizes, dtypes, limit, first, expected):
    assert check_documented_properties(sizes, dtypes, limit, first) == expected


def test_buckets_match_ddps_assignment_for_tensors_of_one_dtype():
    """"As in DDP's bucket assignment": the same runs as `DistributedDataParallel`'s, with
    `first` as its first bucket's limit, wherever the tensors share a dtype (DDP keeps a
    bucket open per dtype, so mixed dtypes are not comparable)."""
    torch = pytest.importorskip("torch")
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    ddp = getattr(c10d, "_compute_bucket_assignment_by_size", None)
    if ddp is None:
        pytest.skip("this torch has no _compute_bucket_assignment_by_size")
    compared = 0
    for sizes, dtypes, limit, first in generated_cases(seed=1):
        if not sizes or len(set(dtypes)) > 1:
            continue
        tensors = [torch.empty(n, dtype=torch.float32) for n in sizes]  # 4 bytes an element
        nbytes = [4 * n for n in sizes]
        limits = [limit] if first is None else [first, limit]
        expected, _ = ddp(tensors, limits, [False] * len(tensors))
        assert buckets(nbytes, dtypes, limit, first) == [list(run) for run in expected], (nbytes, limit, first)
        compared += 1
    assert compared > 50


def chosen(value=None):
    return Settings.from_environ({} if value is None else {"KERAS_DIST_BUCKET_BYTES": value})


def test_bucket_bytes_reads_its_variable_else_the_default():
    assert bucket_bytes(default=123, chosen=chosen()) == 123
    assert bucket_bytes(default=0, chosen=chosen()) == 0
    assert bucket_bytes(default=123, chosen=chosen("")) == 123  # set but empty: the default
    assert bucket_bytes(default=123, chosen=chosen("4096")) == 4096
    assert bucket_bytes(default=0, chosen=chosen("4096")) == 4096
    # 0 is a choice (a collective per tensor), not "unset"
    assert bucket_bytes(default=123, chosen=chosen("0")) == 0


@pytest.mark.parametrize("value", ["25MB", "1e6", "lots", "-5"])
def test_a_bad_bucket_bytes_value_is_a_one_line_error(value):
    from keras_dist.errors import KerasDistError

    with pytest.raises(KerasDistError, match="KERAS_DIST_BUCKET_BYTES") as error:
        chosen(value)
    assert "\n" not in str(error.value)
