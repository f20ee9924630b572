"""Metrics of a run: one record per step, fanned out to metrics.jsonl and the sinks `run.loggers` selects.

log.py          MetricsLog (the fan-out), Timer (per-phase seconds), the console
sinks.py        the Sink protocol and `scalars`, shared by log.py and the optional sinks
tensorboard.py  optional sinks, one module per library: each imports its library at the top and is
wandb.py        itself imported only when `run.loggers` selects it
"""
