"""The C extension (metadata is in pyproject.toml): links OpenSSL's libcrypto (Debian/Ubuntu:
``apt-get install libssl-dev`` to build)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier_native_keys._chain",
                             sources=["src/kvtier_native_keys/_chain.c"],
                             libraries=["crypto"],
                             extra_compile_args=["-O2", "-std=c99"])])
