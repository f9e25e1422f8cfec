"""Benchmarks: scripts run on the GPU machine (see scripts/gpu_check.sh), never timed tests."""
