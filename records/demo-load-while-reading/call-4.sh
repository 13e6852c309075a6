#!/bin/bash
# Call 3 cut to what the session's device time left (2026-12-07): long context with the file
# store's `io_threads` left out (0: 16 on these 16-core hosts) against 8, back to back.
# From the repository root with the wheels in .whl: B=170 bash records/demo-load-while-reading/call-4.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
FA='{"root":"/dev/shm/kvf"}'
v(){ # name, workload args, l3 config, seconds
  el $1
  rm -rf /dev/shm/kvf; timeout $(lim $4) $D $2 --setups "$S" --l3-config "$3" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf; tab $R/$1.log; grep -o '"write_lanes": [0-9]*' $R/$1/results.json | sort | uniq -c
}
v long-auto "$L" "$FA" 90
v long-8 "$L" "$FT" 80
el done
