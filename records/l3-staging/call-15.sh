# Fifteenth device call (on call 14's machine, still warm): where the serving thread's
# Python goes at the demo's defaults (0.1 ms switch interval, loads at dispatch): call 11's
# lock-holder profile (py-spy, 200 Hz, --gil, every thread) of call 13's run, summarised
# over the whole run (gil-summary.py) and under the demo engine's `serve` (spy-summary.py).
# From the repository root with the wheels (py-spy's too) in .whl:
# B=200 bash records/l3-staging/call-15.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh >/dev/null 2>&1; C="$(chain 17179869184 8)"
base="${D#python3 -m kvtier }"
D="/tmp/kv/bin/py-spy record -r 200 --gil --threads --nonblocking -f raw -o $R/gil.raw -- python3 -m kvtier $base"
run gil 140 --clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config "$C" --transfer-engine nvidia-copy-engine --setups 'L1+L2+L3,ideal (all in L1)' >/dev/null
grep -E "^\| (12.3 req/s) " $R/gil.log | cut -d'|' -f1-6,18
python3 records/l3-staging/gil-summary.py $R/gil.raw 200 > $R/gil-summary.txt; head -12 $R/gil-summary.txt
python3 records/l3-staging/spy-summary.py $R/gil.raw > $R/serve-summary.txt; head -60 $R/serve-summary.txt
el done
