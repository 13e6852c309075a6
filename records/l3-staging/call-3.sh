# Third device call: call 2 again after the eviction fix (2152b3f) and the arena fix (f456a00)
# -- the file L3 through L2 against the chain with a 4 GiB and a 16 GiB arena (does the arena's
# size limit it?) under the same load, in one run -- printing the cache's cut and staging counters.
# From the repository root with the wheels in .whl: B=560 bash records/l3-staging/call-3.sh
. records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
cuts(){ python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['cache_metrics'].get('L1+L2+L3',{}); print({k: m.get(k) for k in ('l3_matched_pages','l3_in_place_pages','l3_read_missed_pages','l3_stage_again_fetches','l3_stage_late_fetches')})" $R/$1/results.json; }
LOAD="--clients 16 --rounds 12 --loads 1.05"
run load-file 170 $LOAD --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-config "$FILE"
run load-chain-4g 180 $LOAD --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 4294967296 8)"; cuts load-chain-4g
run load-chain-16g 180 $LOAD --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 17179869184 8)"; cuts load-chain-16g
el done
