#!/bin/bash
# Fourth call: MLA-lite with the file L3 on the host disk, main (new: no calibration, a fetch's
# wait() orders the stream again, cb1cdcb) against 6b72daf (old), alternating; then the 8B
# shape with the file L3 on tmpfs.
NEW=fix
source "$(dirname "$0")/device-lib.sh"
LIM=90; S='L1+L2,L1+L2+L3,L1+L2+L3 load all'
run mla-disk new mla-lite /var/tmp/kvf "$S"
run mla-disk old mla-lite /var/tmp/kvf "$S"
A='L1 only,L1+L2,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)'
LIM=80
run 8b-tmpfs new 8b /dev/shm/kvf "$A"
run 8b-tmpfs old 8b /dev/shm/kvf "$A"
LIM=60
run mla-disk2 new mla-lite /var/tmp/kvf "$S"
run mla-disk2 old mla-lite /var/tmp/kvf "$S"
el done
