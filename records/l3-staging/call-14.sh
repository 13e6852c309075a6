# Fourteenth device call: `kvtier demo`'s defaults under load (0.1 ms switch interval, loads
# at dispatch, no preload) with L1 only beside L1+L2+L3 and the ideal, at call 8's 12.3
# requests/s: the speedup over L1 only, its p99 and the % of the ideal in one run.
# From the repository root with the wheels in .whl: B=300 bash records/l3-staging/call-14.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
rows(){ grep -E "^\| (serial|12.3 req/s) " $R/$1.log | cut -d'|' -f1-9,14-18; grep -A9 "Where a request" $R/$1.log | tail -6; }
run defaults 290 $LOAD --setups 'L1 only,L1+L2+L3,ideal (all in L1)'
rows defaults
el done
