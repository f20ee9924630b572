"""The trainer role: one engine plus what a step asks of it (role.py), run as one Ray worker (hf) or as one
rank per device behind a group that the loop drives like one worker (group.py, the megatron engine)."""
