# Sixteenth device call: where the 2.5 ms of loads in front of L1+L2+L3's prefill go at the
# demo's defaults (calls 13-14: the cache's fetch took 2.1 ms a request, growing 0.94 us per
# loaded token; the serving thread held the interpreter lock for ~0.65 ms of it). A
# wall-clock profile (py-spy, 200 Hz, idle frames kept, every thread) of call 13's run,
# summarised under `TieredKVCache.fetch` and the demo engine's `serve`.
# From the repository root with the wheels (py-spy's too) in .whl:
# B=200 bash records/l3-staging/call-16.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh >/dev/null 2>&1; C="$(chain 17179869184 8)"
base="${D#python3 -m kvtier }"
D="/tmp/kv/bin/py-spy record -r 200 --idle --threads --nonblocking -f raw -o $R/wall.raw -- python3 -m kvtier $base"
run wall 150 --clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config "$C" --transfer-engine nvidia-copy-engine --setups 'L1+L2+L3,ideal (all in L1)' >/dev/null
grep -E "^\| (serial|12.3 req/s) " $R/wall.log | cut -d'|' -f1-6,18
grep -A6 "Where a request" $R/wall.log | tail -4
python3 records/l3-staging/spy-summary.py $R/wall.raw fetch cache/controller.py > $R/fetch-summary.txt; sed -n '/direct children/,$p' $R/fetch-summary.txt | head -45
python3 records/l3-staging/spy-summary.py $R/wall.raw > $R/serve-summary.txt; sed -n '/direct children/,/inclusive/p' $R/serve-summary.txt
el done
