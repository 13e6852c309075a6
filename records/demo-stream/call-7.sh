#!/bin/bash
# After cc00494 (a split that loads part of the L3 hit loads that part; a probe only where
# the split reads no L3 page) on the streamed reads in doubling spans (eca8125), 2026-12-07:
# long context and multi-turn, whole (the default) and streamed, file L3 on /dev/shm, 0.1 ms.
# In call 6 two long-context requests whose split skipped part of a streamed read loaded
# nothing and were recomputed whole. Then the router's per-layer routes of 18 KiB (mla-p16)
# and 32 KiB (mha-32k) chunks each way from an idle GPU against the engines it routes to
# (issue 39, item 5).
# From the repository root with the wheels in .whl: B=330 bash records/demo-stream/call-7.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
printf '[cache]\nl3_stream_layers = true\nl3_stream_min_read_s = 0\n' > /tmp/stream.toml
run_ long-spans "$L" /tmp/stream.toml 90
run_ long-whole "$L" "" 90
run_ mt-spans "" /tmp/stream.toml 60
run_ mt-whole "" "" 60
el transfer
timeout $(lim 120) $K bench transfer --mib 256 --repeat 5 --engines nvidia-routed,nvidia-copy-engine,nvidia-tma --cases mla-p16,mha-32k --modes layer --directions h2d,d2h --json $R/transfer.json > $R/transfer.log 2>&1; echo rc=$?
grep -v "^\s*$" $R/transfer.log | tail -30
el done
