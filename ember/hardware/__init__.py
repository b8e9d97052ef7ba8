"""The machine: devices, precision, peak FLOP/s, the CPU's measured rates and allocator."""
