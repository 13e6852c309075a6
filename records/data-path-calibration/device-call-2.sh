#!/bin/bash
# One paired call: main (the cache's data path on its executor + the recompute calibration,
# "new") against the code before both ("old"), same machine, alternating.
# 1. MLA-lite, file L3 on the host disk (the split loaded a disk slower than recompute).
# 2. 8B shape, file L3 on tmpfs (reads through L2: the prefetch path, the split).
# Second call: the calibration now drops a warm-up pass and hands over per-shape medians.
# Third call (MORE=1): the same, with the calibration timing prefills up to 8/9 of the L1
# pool (was half), then a second new run of each shape.
NEW=cal
source "$(dirname "$0")/device-lib.sh"
A='L1 only,L1+L2,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)'
LIM=100; S='L1+L2,L1+L2+L3,L1+L2+L3 load all'
run mla-disk new mla-lite /var/tmp/kvf "$S"; cal mla-disk-new
run mla-disk old mla-lite /var/tmp/kvf "$S"
LIM=150
run 8b-tmpfs new 8b /dev/shm/kvf "$A"; cal 8b-tmpfs-new
run 8b-tmpfs old 8b /dev/shm/kvf "$A"
if [ -n "$MORE" ]; then
  run 8b-tmpfs2 new 8b /dev/shm/kvf "$A"; cal 8b-tmpfs2-new
  LIM=100
  run mla-disk2 new mla-lite /var/tmp/kvf "$S"; cal mla-disk2-new
fi
el done
