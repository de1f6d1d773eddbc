"""Helpers shared by the benchmarks in tools/ (not part of the infinity package).

measure: resident memory, disk traffic, fio, timing. scratch: swap folders removed on exit and on signals.
trainers: one training step of each framework (plain PyTorch, DDP, FSDP2, DeepSpeed, infinity).
launch: one configuration per subprocess (torchrun for several ranks), rank records merged.
scale_bound: the out-of-core step's lower bound (minimum bytes at fio's bandwidth, in-memory compute).
"""
