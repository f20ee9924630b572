"""Optional metric sinks (rlbridge.metrics.Sink), one module per library: tensorboard, wandb.

Each module imports its library at the top, and is itself imported only when `run.loggers` selects it.
"""
