# Seventh device call: where the serving thread's time goes under load. Call 6's service
# parts put L1+L2+L3 6.7 ms a request above the ideal under load (match 2.1 against 0.2 ms,
# the prefill's wait for its loads 3.8 against 0.1, commit 1.5 against 0.4): host work in
# front of and after the prefill. On the code after the file store's cheaper existence
# check (8d421d9, 2182e6b) and one writer per stage helper (93f7705): a sampling profile (py-spy,
# 250 Hz, idle frames kept, every thread) of call 6's copy-engine run, L1+L2+L3 and the ideal
# at 12.3 requests/s (105% of call 6's L1-only capacity, 11.73/s).
# From the repository root with the wheels (py-spy's too) in .whl:
# B=300 bash records/l3-staging/call-7.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
el profile
rm -rf /dev/shm/kvf /dev/shm/kvs-*
timeout $(lim 280) /tmp/kv/bin/py-spy record -r 250 --idle --nonblocking --threads -f raw -o $R/prof.raw -- \
  $D --clients 16 --rounds 12 --rate 12.3 --setups 'L1+L2+L3,ideal (all in L1)' \
  --l3-store chain --l3-config "$C" --transfer-engine nvidia-copy-engine --out $R/profile \
  > $R/profile.log 2>&1; echo rc=$?
rm -rf /dev/shm/kvf /dev/shm/kvs-*
grep -A8 "Where a request" $R/profile.log
el done
