"""`python -m kvtier ...` with the interpreter's thread switch interval set first (seconds;
CPython's default is 0.005): how long a thread that wants the interpreter lock waits for one
that holds it and runs Python.

    python records/l3-staging/switch-interval.py 0.0001 demo ...
"""
import sys

from kvtier.cli import main

sys.setswitchinterval(float(sys.argv[1]))
sys.exit(main(sys.argv[2:]))
