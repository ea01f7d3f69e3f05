"""The timing harness behind ``normkit bench``: not part of the library's API.

``normkit.bench.ops`` times normkit's normalizations against torch's native ones and a
memory copy on the CPU (each allocator setting in a child process, ``python -m
normkit.bench``); ``normkit.bench.gpu`` does the same on a CUDA device for the Triton
kernels. ``normkit.cli.bench`` parses the arguments and prints; the scripts in
``benchmarks/`` are front ends too.
"""
