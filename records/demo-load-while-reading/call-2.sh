#!/bin/bash
# Call 1's runs separated (2026-12-07): the fetch that loads each L3 batch as it lands
# against the one that waits for the whole read, at 8 and at 16 I/O threads of the file store,
# interleaved and twice on multi-turn (call 1's first run ran out of its 40 s: the machine's
# first demo run also builds the model and calibrates the router); long context at 16
# threads, and with batches of 32 pages (finer pipelining, twice the store calls).
# From the repository root with the wheels in .whl: B=560 bash records/demo-load-while-reading/call-2.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
printf '[cache]\nl3_load_while_reading = false\n' > /tmp/after.toml
printf '[cache]\nl3_batch_pages = 32\n' > /tmp/b32.toml
FT16='{"root":"/dev/shm/kvf","io_threads":16}'
v(){ # name, workload args, config file or "", l3 config, seconds
  el $1
  if [ -n "$3" ]; then export KVTIER_CONFIG=$3; else unset KVTIER_CONFIG; fi
  rm -rf /dev/shm/kvf; timeout $(lim $5) $D $2 --setups "$S" --l3-config "$4" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf; unset KVTIER_CONFIG; tab $R/$1.log
}
v mt-new-1 "" "" "$FT" 100
v mt-old-1 "" /tmp/after.toml "$FT" 45
v mt-new-2 "" "" "$FT" 45
v mt-old-2 "" /tmp/after.toml "$FT" 45
v mt-old16 "" /tmp/after.toml "$FT16" 45
v long-old16 "$L" /tmp/after.toml "$FT16" 80
v long-new16 "$L" "" "$FT16" 80
v long-new16-b32 "$L" /tmp/b32.toml "$FT16" 80
el done
