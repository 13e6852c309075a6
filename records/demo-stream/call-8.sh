#!/bin/bash
# Streamed reads in doubling spans with larger store calls (2026-12-07): in call 7 a streamed
# long-context request read its L3 pages at 11.4 GB/s beside its prefill (6 calls of 64
# pages per span, each ending when its slowest I/O thread does) against 19.2 GB/s for whole
# reads before it. Here `l3_batch_pages = 256` for the streamed runs, whole reads (default
# batches) in the same call as the baseline.
# From the repository root with the wheels in .whl: B=200 bash records/demo-stream/call-8.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
printf '[cache]\nl3_stream_layers = true\nl3_stream_min_read_s = 0\nl3_batch_pages = 256\n' > /tmp/stream.toml
run_ mt-spans-b256 "" /tmp/stream.toml 40
run_ mt-whole "" "" 40
run_ long-spans-b256 "$L" /tmp/stream.toml 75
run_ long-whole "$L" "" 75
el done
