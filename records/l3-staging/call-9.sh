# Ninth device call: call 8 again after a request arriving during a prefill (nothing queued)
# is preloaded at its arrival (call 8: only at the launch of the prefill ahead, 15% of
# requests preloaded). The next queued request's hits loaded into L1 while the request ahead
# prefills (DemoEngine.preload), against every load at dispatch (--no-preload), on call 6's
# copy-engine run: L1+L2+L3 and the ideal at 12.3 requests/s (105% of call 6's L1-only
# capacity, 11.73/s; L1 only in the first run for the speedups).
# From the repository root with the wheels in .whl: B=420 bash records/l3-staging/call-9.sh
# (Preload was the default then; on later code the first run needs --preload.)
# The same two runs as call 8, on the code of d024da1:
. records/l3-staging/call-8.sh
