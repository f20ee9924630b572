"""The model a recipe names, before any engine loads it: facts from config.json (info.py, no weights), the
local copy (cache.py: short names -> a directory), random-weight stand-ins (random_weights.py), the
tokenizer, and the shrunk random copy of `rlbridge train --smoke` (smoke.py)."""
