"""kvtier-example-sqlite: an example kvtier backend package (an L3 store in a SQLite file).

Importing the package imports no backend runtime: the store module does that in ``probe()``
and construction, so ``import kvtier`` and ``kvtier backends`` stay cheap and never fail
because of this package.
"""

#: The kvtier interface version the backends here were written for. kvtier's registry refuses
#: a backend whose version differs from its own INTERFACE_VERSION, so a stale build is caught
#: at discovery instead of failing later in the middle of a request.
KVTIER_INTERFACE_VERSION = 1

__version__ = "0.1.0"
