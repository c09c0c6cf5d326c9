"""How plait's own Spark sessions are set up, without starting Spark."""

from __future__ import annotations

import pytest

from plait.spark.session import TASK_TRIES, with_task_retries


@pytest.mark.parametrize(
    ("master", "expected"),
    [
        ("local", f"local[1,{TASK_TRIES}]"),
        ("local[2]", f"local[2,{TASK_TRIES}]"),
        ("local[*]", f"local[*,{TASK_TRIES}]"),
        (" local[*] ", f"local[*,{TASK_TRIES}]"),
        ("local[2,1]", "local[2,1]"),  # the user chose no retries
        ("local-cluster[2,1,1024]", "local-cluster[2,1,1024]"),
        ("spark://127.0.0.1:7077", "spark://127.0.0.1:7077"),
        ("yarn", "yarn"),
    ],
)
def test_local_masters_retry_failed_tasks_as_a_cluster_does(master: str, expected: str) -> None:
    assert with_task_retries(master) == expected
