#!/bin/bash
# One paired call: main (the cache's data path on its executor + the recompute calibration,
# "new") against the code before both ("old"), same machine, alternating.
# 1. 8B shape, file L3 on tmpfs (reads through L2: the prefetch path, the split).
# 2. MLA-lite, file L3 on the host disk (the split loaded a disk slower than recompute).
NEW=cal
source "$(dirname "$0")/device-lib.sh"
A='L1 only,L1+L2,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)'
LIM=150
run 8b-tmpfs new 8b /dev/shm/kvf "$A"
run 8b-tmpfs old 8b /dev/shm/kvf "$A"
LIM=100; S='L1+L2,L1+L2+L3,L1+L2+L3 load all'
run mla-disk new mla-lite /var/tmp/kvf "$S"
run mla-disk old mla-lite /var/tmp/kvf "$S"
LIM=100
run mla-disk2 new mla-lite /var/tmp/kvf "$S"
el done
