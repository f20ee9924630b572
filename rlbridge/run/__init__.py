"""The run directory and what keeps a run safe to stop and continue: its layout (directory.py), the on-disk
checkpoint format (checkpoint.py), saving and resuming (resume.py), SIGTERM / Ctrl-C (signals.py), and the
named fault points tests use to kill a process at an exact phase (faults.py)."""
