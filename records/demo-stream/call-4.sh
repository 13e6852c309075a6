#!/bin/bash
# One device call, after l3_stream_min_read_s = 0.1 s at the rate of whole reads (2026-12-06).
# Wheels as in call-1.sh. Run from the repository root: B=560 bash records/demo-stream/call-4.sh
#  multi-turn: default, whole; long context: default; the host disk: L1+L2 against L1+L2+L3.
# Helpers: common.sh. It ran on the code named in records/demo-stream.md, where streaming was
# on by default ("stream" and "default" below); since 4af217e the default reads whole.
. records/demo-stream/common.sh
one mt-default "" default "$S" "$FT" 60
one mt-disk "" default 'L1 only,L1+L2,L1+L2+L3,ideal (all in L1)' '{"root":"/tmp/kvd"}' 70
one long-default "$L" default "$S" "$FT" 90
one mt-whole "" whole "$S" "$FT" 60
el done
