"""Data for the step loop: prompts in, rewards out.

- `datasets`: load jsonl / parquet / `builtin:arithmetic` into `Prompt`s, render and tokenize them, and
  `PromptSampler`, the resumable per-epoch shuffle.
- `rewards`: the reward-function protocol, the builtins (arithmetic, gsm8k, format) and `check_reward_fn`,
  which recipe validation calls (so that module imports only the standard library).
- `reward_pool`: `RewardPool`, which runs user reward functions in killable worker processes with a
  per-sample timeout and a run-wide error budget.

Nothing is re-exported here, so importing `rlbridge.data.rewards` stays cheap.
"""
