#!/bin/bash
# One device call, after reads got their own L3 worker and file-store threads and the
# streamed split learnt the wait before the first layer group (2026-12-06).
# Wheels as in call-1.sh. Run from the repository root: B=560 bash records/demo-stream/call-2.sh
#  1. 8B multi-turn, file L3 on tmpfs (8 I/O threads): streamed, whole (l3_stream_layers =
#     false), streamed, whole -- alternated, each with its own L1-only and ideal runs;
#  2. the long-context pair;
#  3. the file L3 on the host disk, streamed, against L1+L2;
#  4. the file store on /dev/shm against its raw modes (512 MiB per measurement).
# Helpers: common.sh. It ran on the code named in records/demo-stream.md, where streaming was
# on by default ("stream" and "default" below); since 4af217e the default reads whole.
. records/demo-stream/common.sh
one mt-stream-1 "" stream "$S" "$FT" 60
one mt-whole-1 "" whole "$S" "$FT" 60
one mt-disk "" stream 'L1 only,L1+L2,L1+L2+L3,ideal (all in L1)' '{"root":"/tmp/kvd"}' 70
one long-stream "--workload long --clients 4 --rounds 4" stream "$S" "$FT" 90
one long-whole "--workload long --clients 4 --rounds 4" whole "$S" "$FT" 90
one mt-stream-2 "" stream "$S" "$FT" 60
one mt-whole-2 "" whole "$S" "$FT" 60
el store-shm
timeout $(lim 120) $K bench store --dir /dev/shm/kvb --total 512M --page-sizes 1M,2M,4M,8M --repeat 2 --threads 8 --json $R/store-shm.json > $R/store-shm.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvb
tail -12 $R/store-shm.log
el done
