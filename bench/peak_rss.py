#!/usr/bin/env python3
"""Runs a command and prints its peak resident set size on stderr when it ends:

    bench/peak_rss.py PROGRAM [ARGS...]      ->  peak_rss_mib <MiB>   (exit status: the program's)

Used by bench/cpu_step_time.sh as the rank program under mfsdp-run, so that every rank's peak
RSS lands in the log with the launcher's [rankN] tag (mfsdp-pretrain itself reports rank 0's).
getrusage(RUSAGE_CHILDREN) after the wait is the peak of the one child, not of this wrapper.
"""
import resource
import subprocess
import sys

if len(sys.argv) < 2:
    sys.exit("usage: peak_rss.py PROGRAM [ARGS...]")
status = subprocess.call(sys.argv[1:])
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
print("peak_rss_mib %.1f" % (peak_kib / 1024.0), file=sys.stderr, flush=True)
sys.exit(status if status >= 0 else 128 - status)
