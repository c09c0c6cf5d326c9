"""What signing Redis messages with replication.secret costs (R-RP-9).

The publisher signs each message (one PUBLISH: a batch of lines) with one HMAC-SHA256;
each receiver verifies it and checks every line's instance against the signed sender.
This measures that client CPU in-process, without Redis (where it would drown in the
network's noise): per message of 1, 10, 100 lines and a full 64 KiB message of RDATA
lines of about 160 bytes, the microseconds to sign, to verify, and to check the lines
(`foreign`), next to what the receiver did already per line (split, command name, the
own-echo test), median of the repetitions. The figure is the added cost per line.

Run: python bench/redis_signing.py [--reps 9] [--lines 200000]
"""

from __future__ import annotations

import argparse
import time

from common import add_smoke_arg, emit, log, median, parse, rnd
from plait.core.commands import command_name, rows_of
from plait.core.signed_messages import Signer, Verifier, foreign, key_of

CHANNEL = "plait.bench"
KEY = key_of("a long random secret of the deployment, 32+ characters")
ROW = '["events",{token},"w1","' + "x" * 100 + '"]'


def message_body(lines: int, first: int) -> bytes:
    return "\n".join(
        f"RDATA events w1 {first + i} {ROW.format(token=first + i)}" for i in range(lines)
    ).encode()


def one_run(lines_per_message: int, total_lines: int) -> dict[str, float]:
    """Seconds per line of each step, over `total_lines` lines."""
    count = max(1, total_lines // lines_per_message)
    bodies = [message_body(lines_per_message, i * lines_per_message) for i in range(count)]
    signer = Signer(KEY, CHANNEL, "w1", "0123456789abcdef")
    now = int(time.time() * 1000)

    started = time.perf_counter()
    messages = [signer.sign(body, now) for body in bodies]
    sign = time.perf_counter() - started

    verifier = Verifier(KEY, CHANNEL, max_skew_ms=60_000)
    started = time.perf_counter()
    for message in messages:
        verifier.check(message, now)
    verify = time.perf_counter() - started

    split = [message.split(b"\n")[1:] for message in messages]
    started = time.perf_counter()
    for message_lines in split:
        for line in message_lines:
            foreign(line, b"w1")
    check = time.perf_counter() - started

    started = time.perf_counter()  # what the receiver did per line before signing
    for body in bodies:
        for line in body.split(b"\n"):
            command_name(line[:16].decode(errors="replace"))
            rows_of(line, b"r")
    before = time.perf_counter() - started

    n = count * lines_per_message
    return {"sign": sign / n, "verify": verify / n, "check": check / n, "before": before / n}


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--reps", "1", "--lines", "2000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_arg(parser)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--lines", type=int, default=200_000)
    args = parse(parser, SMOKE)
    full = 64 * 1024 // (len(message_body(1, 10**6)) + 1)  # lines in a 64 KiB message
    for lines_per_message in (1, 10, 100, full):
        samples: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for step, seconds in one_run(lines_per_message, args.lines).items():
                samples.setdefault(step, []).append(seconds)
        us = {step: median(values) * 1e6 for step, values in samples.items()}
        added = us["sign"] + us["verify"] + us["check"]
        log(
            f"{lines_per_message} line(s)/message: sign {us['sign']:.3f} µs/line, verify "
            f"{us['verify']:.3f}, check {us['check']:.3f} (added {added:.3f}; the receiver's "
            f"per-line work before: {us['before']:.3f})"
        )
        emit(
            {
                "bench": "redis_signing",
                "lines_per_message": lines_per_message,
                "line_bytes": len(message_body(1, 10**6)),
                "sign_us_per_line": rnd(us["sign"], 3),
                "verify_us_per_line": rnd(us["verify"], 3),
                "check_us_per_line": rnd(us["check"], 3),
                "added_us_per_line": rnd(added, 3),
                "before_us_per_line": rnd(us["before"], 3),
                "sign_and_verify_us_per_message": rnd(
                    (us["sign"] + us["verify"]) * lines_per_message, 3
                ),
                "reps": args.reps,
            }
        )


if __name__ == "__main__":
    main()
