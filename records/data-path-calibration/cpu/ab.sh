#!/bin/bash
# paired CPU demo, alternating, twice each: OLD = a checkout of 6b72daf (before), MAIN = this
# checkout; run as OLD=... MAIN=... bash ab.sh
for i in 1 2; do
  for code in new old; do
    if [ $code = old ]; then PP=$OLD/packages/core/src:$OLD/packages/tools/src; else PP=$MAIN/packages/core/src:$MAIN/packages/tools/src; fi
    PYTHONPATH=$PP timeout 600 python -m kvtier demo --no-progress --no-plot --out /tmp/ab-$code-$i > /tmp/ab-$code-$i.log 2>&1
    echo "$code $i rc=$?"; grep -A7 "^| setup             | hit rate" /tmp/ab-$code-$i.log | head -7 | cut -d'|' -f2,8,11
  done
done
