"""PPO on the megatron engine, in one process (gloo world of 1): the loop's train_step driving a TrainerRole
whose policy and critic are megatron models, with test_algorithms_learn.py's hf rollout and easy task.
Run as a subprocess by test_ppo_megatron_learn.py (the pytest process never imports megatron):

    python tests/integration/megatron_ppo_run.py MODEL_DIR RUN_DIR OUT_JSON [SPEC_JSON]

SPEC_JSON (optional): {"algorithm": {...}, "steps": N, "updates": {dotted key: value}} for make_recipe and
test_ppo_learn.with_updates; default PPO with critic lr 1e-2, 8 steps.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    import torch.distributed as dist

    from rlbridge.engines.megatron import compat

    torch.set_num_threads(2)
    compat.activate()
    from rlbridge.loop import train_step
    from rlbridge.trainer.client import LocalTrainer
    from tests.fixtures.local_session import local_session
    from tests.integration.test_algorithms_learn import make_recipe
    from tests.integration.test_ppo_learn import with_updates

    model_dir, run_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    algorithm = spec.get("algorithm", {"name": "ppo", "critic": {"lr": 1e-2}})
    base = make_recipe(model_dir, algorithm, **({"steps": spec["steps"]} if "steps" in spec else {}))
    recipe = with_updates(base, {**spec.get("updates", {}), "trainer.engine": "megatron"})

    dist.init_process_group(
        "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    with local_session(recipe, run_dir, model_dir) as s:  # the engine registry builds the megatron engine
        assert isinstance(s.trainer, LocalTrainer)
        role = s.trainer.role
        kinds = {"engine": type(role.engine).__name__, "critic": type(role.critic).__name__}
        records = [train_step(s, step) for step in range(1, recipe.run.steps + 1)]
    out.write_text(json.dumps({**kinds, "records": records}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
