"""`keras.utils.get_file` on every process of a job, as keras.io's examples fetch their data.

    downloads.py OUT URL

Every process: an archive fetched and extracted (`extract=True`), its file read at once,
a plain file fetched, and an address the server refuses. Writes `OUT/report.RANK.json`:
what each read, and what each missing download raised.
"""

import json
import os
import sys

import keras

import keras_dist

OUT, URL = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("RANK", os.environ.get("KERAS_DIST_RANK", "0")))
strategy = keras_dist.init()
cache = os.path.join(OUT, "cache")
os.makedirs(cache, exist_ok=True)  # else get_file falls back to /tmp/.keras
report = {}
extracted = keras.utils.get_file(origin=f"{URL}/archive.tar.gz", extract=True, cache_dir=cache)
with open(os.path.join(extracted, "archive", "values.csv")) as f:
    report["extracted"] = f.read()
with open(keras.utils.get_file(origin=f"{URL}/plain.txt", cache_dir=cache)) as f:
    report["plain"] = f.read()
try:
    keras.utils.get_file(origin=f"{URL}/missing.zip", cache_dir=cache)
except Exception as error:  # noqa: BLE001 - Keras raises a bare Exception for a failed fetch
    report["missing"] = f"{type(error).__name__}: {error}"
with open(os.path.join(OUT, f"report.{strategy.rank}.json"), "w") as f:
    json.dump(report, f)
