"""A quiet local SparkSession with the plait source registered: no banner and no INFO
or WARN lines from Spark's logs on the console, only errors."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

# Errors only, to stderr (Spark's own default prints INFO and a banner line).
_LOG4J2 = """\
# Spark prints "Setting default log level" when its own logger's level differs from
# the root's: both are ERROR here.
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
logger.apache.name = org.apache
logger.apache.level = error
logger.sparkproject.name = org.sparkproject
logger.sparkproject.level = error
logger.netty.name = io.netty
logger.netty.level = error
"""


def log_config() -> Path:
    """The log4j2 configuration file (written once per user)."""
    path = Path(tempfile.gettempdir()) / f"plait-spark-log4j2-{os.getuid()}.properties"
    if not path.exists() or path.read_text() != _LOG4J2:
        path.write_text(_LOG4J2)
    return path


def quiet_session(
    app_name: str = "plait", master: str = "local[*]", conf: dict[str, str] | None = None
) -> Any:
    """A SparkSession (the one already running, if any) that logs errors only, with
    the `plait` data source registered."""
    from pyspark.sql import SparkSession

    import plait.spark

    java_options = f"-Dlog4j2.configurationFile=file:{log_config()}"
    builder = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.driver.extraJavaOptions", java_options)
        .config("spark.executor.extraJavaOptions", java_options)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    plait.spark.register(spark)
    return spark
