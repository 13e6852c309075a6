#!/bin/bash
# The file store's I/O threads by the medium (2026-12-07): `io_threads` left out (0: one per
# CPU in memory, 4 to 16; 16 on these 16-core hosts) against the 8 of calls 1-2, both with the
# fetch's defaults (whole reads, then loads beside the prefill), interleaved; the store's write
# lanes (one per I/O thread in memory) say how many threads it ran.
# From the repository root with the wheels in .whl: B=400 bash records/demo-load-while-reading/call-3.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
FA='{"root":"/dev/shm/kvf"}'
v(){ # name, workload args, l3 config, seconds
  el $1
  rm -rf /dev/shm/kvf; timeout $(lim $4) $D $2 --setups "$S" --l3-config "$3" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf; tab $R/$1.log; grep -o '"write_lanes": [0-9]*' $R/$1/results.json | sort | uniq -c
}
v mt-auto-1 "" "$FA" 100
v mt-8 "" "$FT" 45
v mt-auto-2 "" "$FA" 45
v long-auto "$L" "$FA" 80
v long-8 "$L" "$FT" 80
el done
