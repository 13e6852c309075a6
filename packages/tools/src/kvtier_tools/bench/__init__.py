"""``kvtier bench <what>``: benchmarks as commands, each in its own module here.

A benchmark module defines ``add_arguments(parser)`` and ``run(args) -> int`` and is registered
as an entry point ``bench.<what>`` of the group ``kvtier.commands`` (see `kvtier.cli`); vendor
packages add theirs the same way (kvtier-nvidia-tma: ``kvtier bench limits``). Benchmarks
measure the ceiling they compare against in the same run and print a table of ratios.
"""
