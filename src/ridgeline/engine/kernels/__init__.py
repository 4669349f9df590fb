"""The engine's C kernels (sources in csrc/, built on first use by kernel_build.py) and their
Python wrappers: paged attention, small-batch linear layers, the fused decode operations
and the one-call decode stack."""
