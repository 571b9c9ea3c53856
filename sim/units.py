"""Units, defined once. Sizes are binary (KiB, MiB, GiB); rates are decimal (GB/s = 1e9 B/s), as the
datasheets and benchmarks quote them (reference/hardware-and-gguf.md, "Units")."""

KIB = 1 << 10  # bytes
MIB = 1 << 20  # bytes
GIB = 1 << 30  # bytes
GB = 1e9  # bytes, for rates in GB/s
US = 1e-6  # seconds per microsecond
MS = 1e-3  # seconds per millisecond
