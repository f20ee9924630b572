"""The run directory and what keeps a run safe to stop and continue: its layout (directory.py), the on-disk
checkpoint format (checkpoint.py), saving and resuming (resume.py) with the rule for which recipe changes a
resume accepts (resume_policy.py), the process's RNG states (rng.py), pid_alive (process.py), SIGTERM /
Ctrl-C (signals.py), and the named fault points tests use to kill a process at an exact phase (faults.py)."""
