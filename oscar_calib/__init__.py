"""oscar-calib: offline calibration of OSCAR rotations and clip ratios for 2-bit KV caches."""

__version__ = "0.1.0"
