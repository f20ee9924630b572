"""The model a recipe names, before any engine loads it: facts from config.json (info.py, no weights), the
local copy (cache.py: short names -> a directory), random-weight stand-ins (random_weights.py), the
tokenizer, the shrunk random copy of `rlbridge train --smoke` (smoke.py), and what the trainer engines and the
rollout share about a mixture-of-experts model: expert names (experts.py) and routing replay (routing.py)."""
