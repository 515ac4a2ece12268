"""Parallelism lab: pipeline schedules and their simulator, a pipeline executor over
`torch.distributed` point-to-point, Megatron tensor parallelism, FSDP, a communication benchmark
and a strategy scan. See `docs/parallelism.md`. Nothing here imports torch at package import."""
