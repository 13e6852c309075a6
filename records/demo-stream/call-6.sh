#!/bin/bash
# Streamed L3 reads in doubling spans (2026-12-07): a page's 8 layer groups read as group 0,
# group 1, groups 2-3 and groups 4-7 (`l3_stream_spans`, the default with streaming), one
# ranged read and one load per span, against whole reads in the same call. Call 5 measured
# one read per group at 0.1 ms: streaming lost (long context 54% of the ideal against 68%,
# multi-turn 59% against 73%), its groups at 9-11 GB/s against whole reads' 15-16 and run one
# after another (8 x 6.3 ms a request on multi-turn against one 17.7 ms whole read).
# First the store alone on /dev/shm (28 and 112 pages of 8 MiB: whole, one call per group,
# doubling spans; with a thread launching GPU work beside), then multi-turn and long
# context, whole and streamed in spans, then multi-turn streamed one group a call (control).
# From the repository root with the wheels in .whl: B=420 bash records/demo-stream/call-6.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
el store
for N in 28 112; do echo "== $N pages"; N=$N T=8 timeout $(lim 60) python3 records/demo-stream/groups_bench.py; done 2>&1 | tee $R/store.txt
printf '[cache]\nl3_stream_layers = true\nl3_stream_min_read_s = 0\n' > /tmp/stream.toml
printf '[cache]\nl3_stream_layers = true\nl3_stream_min_read_s = 0\nl3_stream_spans = false\n' > /tmp/groups.toml
run_ mt-whole "" "" 60
run_ mt-spans "" /tmp/stream.toml 60
run_ long-whole "$L" "" 90
run_ long-spans "$L" /tmp/stream.toml 90
run_ mt-groups "" /tmp/groups.toml 60
el done
