"""Pure-torch RL math: advantage estimators (`advantages`) and policy / value / KL losses (`losses`)."""
