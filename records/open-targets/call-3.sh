#!/bin/bash
# Call 2 cut to what the device time left allowed: the file store's batch_set / batch_get of
# 1 MiB and 8 MiB pages into tmpfs with 16 I/O threads, at CPython's 5 ms switch interval and
# at the demo's 0.1 ms, alternating (is the per-page cost of 1 MiB writes the interpreter lock?).
# From the repository root with the wheels in .whl: bash records/open-targets/call-3.sh
rm -rf /tmp/res; . records/demo-stream/common.sh >/dev/null 2>&1
W=records/open-targets/store_writes.py
for sw in 0 0.1 0 0.1; do timeout 40 python3 $W /dev/shm/kvw 1 16 1024 $sw 2>&1 | tee -a $R/writes.log; done
for sw in 0 0.1; do timeout 40 python3 $W /dev/shm/kvw 8 16 128 $sw 2>&1 | tee -a $R/writes.log; done
rm -rf /dev/shm/kvw; cp $R/writes.log $OUT/ 2>/dev/null; el done
