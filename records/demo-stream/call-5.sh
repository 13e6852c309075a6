#!/bin/bash
# Streamed against whole L3 reads again, now that the demo runs at a 0.1 ms thread switch
# interval (2026-12-07). Calls 1-4 ran at CPython's 5 ms, where the streamed groups came 2-3x
# slower than whole reads beside the prefill and the prefill itself 7-30 ms longer: the
# interval that made the prefill grow beside kvtier's threads (records/l3-staging.md, calls
# 11-16). Long context and multi-turn, file L3 on /dev/shm, whole (the default) and
# streamed (`l3_stream_layers = true`, `l3_stream_min_read_s = 0`); then long context
# streamed at 5 ms (`--switch-interval-ms 0`) as the control.
# From the repository root with the wheels in .whl: B=420 bash records/demo-stream/call-5.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
printf '[cache]\nl3_stream_layers = true\nl3_stream_min_read_s = 0\n' > /tmp/stream.toml
case_(){ # name, workload args, default|stream, seconds, extra demo args
  el $1
  if [ "$3" = stream ]; then export KVTIER_CONFIG=/tmp/stream.toml; else unset KVTIER_CONFIG; fi
  rm -rf /dev/shm/kvf; timeout $(lim $4) $D $2 $5 --setups "$S" --l3-config "$FT" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf; unset KVTIER_CONFIG; tab $R/$1.log
}
case_ long-whole "$L" default 90
case_ long-stream "$L" stream 90
case_ mt-whole "" default 60
case_ mt-stream "" stream 60
case_ long-stream-5ms "$L" stream 90 "--switch-interval-ms 0"
el done
