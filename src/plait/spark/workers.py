"""What plait does to the Spark Python worker processes it runs in.

Spark's Python daemon runs a full `gc.collect()` after every task a worker finishes
(pyspark/daemon.py), and after each planning call. With pyspark, pyarrow, psycopg and
the ADBC driver loaded, a worker holds about 70 000 objects that live as long as it
does, and each of those collections walks all of them: 35-60 ms a task, measured, or
some 0.2 s of CPU for a read of four tasks on two cores. `settle()` collects once and
then freezes what is alive (`gc.freeze()`): later collections walk only what later
tasks made, and still free it.
"""

from __future__ import annotations

import gc
import sys

_settled = False


def in_spark_worker() -> bool:
    """Whether this process is one of Spark's Python workers (forked from
    `python -m pyspark.daemon`, or started as `python -m pyspark.worker` and such)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and str(spec.name).startswith("pyspark.")


def settle() -> None:
    """Once per process, in Spark's workers only (never in a user's own process):
    freeze the long-lived objects loaded so far, so the collection Spark runs after
    each task does not walk them again."""
    global _settled
    if _settled:
        return
    _settled = True
    if in_spark_worker():
        gc.collect()  # free what is garbage already rather than freeze it
        gc.freeze()
