"""The checker's summary table, for people (`--json` gives the same as one line)."""

from __future__ import annotations

from rich.table import Table

from plait.check.report import Report


def summary(report: Report) -> list[Table]:
    run = Table(title=f"plait check: {'OK' if report.ok else 'VIOLATIONS'}", show_header=False)
    run.add_column(style="bold")
    run.add_column(justify="right")
    options = report.options
    run.add_row("transport", options.transport)
    run.add_row("writers x streams", f"{options.writers} x {options.streams}")
    run.add_row("seed", str(report.seed))
    run.add_row("time", f"{report.elapsed:.0f} s ({options.duration:g} s of faults)")
    run.add_row("rows committed", f"{report.committed:,}")
    run.add_row("rolled back / failed IDs", f"{report.rolled_back:,} / {report.failed:,}")
    for kind, n in sorted(report.faults.counts.items()):
        run.add_row(f"faults: {kind}", str(n))
    for kind, n in sorted(report.faults.failed.items()):
        # Tried again later, so the count above still reached the schedule's.
        reason = report.faults.last_failure.get(kind, "")
        run.add_row(f"could not inject: {kind}", f"{n} (last: {reason})" if reason else str(n))
    if report.faults.outages:
        run.add_row("transport down", f"{report.faults.transport_down():.1f} s")
    if report.faults.db_outages:
        run.add_row("PostgreSQL down", f"{report.faults.db_down():.1f} s")
    partitions = [p for ps in report.faults.partitions.values() for p in ps]
    if partitions:
        cut = sum(1 for p in partitions if p.cut is not None)
        bound = f"{report.keepalive_bound:g} s"
        run.add_row(
            "writers partitioned from PostgreSQL",
            f"{len(partitions)} (connections dropped after {bound}: {cut})",
        )
    run.add_row("writers fenced while alive (exited)", str(report.faults.fenced_alive))
    run.add_row("writers fenced while alive (renewed)", str(report.renewed))
    run.add_row("writer restarts", str(report.faults.restarts))
    run.add_row("crashes", str(len(report.faults.crashes)))
    if report.faults.revived:
        run.add_row(
            "Spark queries restarted after failing in a PostgreSQL fault",
            f"{len(report.faults.revived)} (last: {_short(report.faults.revived[-1])})",
        )
    run.add_row("own positions gone back", str(len(report.own_regressions)))
    readers = Table(
        title=f"readers (stall bound {options.stall_bound:g} s"
        + (f", spark {options.spark_stall_bound:g} s" if options.spark else "")
        + "; replication readers' stalls leave out the time the transport was down"
        + (", Spark's the time its queries restarted" if options.spark else "")
        + (", everyone's the time PostgreSQL was down" if report.faults.db_outages else "")
        + ")"
    )
    for column in ("reader", "delivered", "lost", "duplicated", "phantom", "regressions"):
        readers.add_column(column, justify="left" if column == "reader" else "right")
    readers.add_column("stale", justify="right")
    readers.add_column("longest stall", justify="right")
    for r in report.readers:
        stall = f"{r.longest_stall:.2f} s ({r.stall_at})" if r.name != "worker" else "-"
        if not r.bounded:
            stall += ", not bounded"
        readers.add_row(
            r.name,
            f"{r.delivered:,}",
            str(r.lost),
            str(r.duplicated),
            str(r.phantom),
            str(r.regressions),
            str(r.stale),
            stall,
        )
    deaths = [f"{r.name} stopped reading: {r.died}" for r in report.readers if r.died]
    if deaths:
        readers.caption = "\n".join(deaths)
    return [run, readers]


def _short(cause: str) -> str:
    """The cause part of a Spark error line (`error_lines.error_line`), at most 100 chars."""
    text = cause.strip('"').split(" ... ")[-1]
    return text if len(text) <= 100 else text[:99] + "…"
