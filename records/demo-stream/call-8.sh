#!/bin/bash
# Streamed reads in doubling spans with larger store calls (2026-12-07): in call 7 a streamed
# long-context request read its L3 pages at 11.4 GB/s beside its prefill (6 calls of 64
# pages per span, each ending when its slowest I/O thread does) against 19.2 GB/s for whole
# reads before it. Here `l3_batch_pages = 256` for the streamed runs, whole reads (default
# batches) in the same call as the baseline.
# From the repository root with the wheels in .whl: B=200 bash records/demo-stream/call-8.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
printf '[cache]\nl3_stream_layers = true\nl3_stream_min_read_s = 0\nl3_batch_pages = 256\n' > /tmp/stream.toml
case_(){ # name, workload args, default|stream, seconds
  el $1
  if [ "$3" = stream ]; then export KVTIER_CONFIG=/tmp/stream.toml; else unset KVTIER_CONFIG; fi
  rm -rf /dev/shm/kvf; timeout $(lim $4) $D $2 --setups "$S" --l3-config "$FT" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf; unset KVTIER_CONFIG; tab $R/$1.log
}
case_ mt-spans-b256 "" stream 40
case_ mt-whole "" default 40
case_ long-spans-b256 "$L" stream 75
case_ long-whole "$L" default 75
el done
