"""Tests of the benchmarks (benchmarks/): their smoke runs on a CPU, reports and recipes."""
