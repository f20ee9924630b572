"""Security checks on the source (fast, no Ray started).

- No pickle on any load path: no call in rlbridge/ of `torch.load`, `pickle.load(s)`, `cloudpickle` /
  `dill` / `joblib` / `marshal` loads, `np.load(..., allow_pickle=True)`, `yaml.load` without SafeLoader,
  `yaml.unsafe_load` / `full_load`. Checkpoints are safetensors + JSON, recipes YAML (safe loader),
  datasets JSON/JSONL/parquet. The scan parses the code (comments and strings cannot trip it, and aliases
  such as `from pickle import loads` are caught); it is itself tested on planted code.
- The Ray dashboard is off: every `ray.init(...)` in rlbridge/ passes `include_dashboard=False`.

Elsewhere (referenced in docs/reliability.md): a `!!python/object` recipe is refused and never executed
(tests/unit/recipe/test_recipe_load.py::test_python_tag_is_refused_not_executed); paths that would escape a root
are refused (tests/unit/run/test_checkpoint.py::test_safe_join_refuses_escapes, used by export and by manifest
verification); a planted WANDB_API_KEY never reaches the run directory or logs (tests/unit/metrics/test_loggers.py).

Reproduce: `.venv/bin/python -m pytest tests/reliability/test_security.py -v`
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlbridge"

UNSAFE_CALLS = {
    "torch.load",
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "cPickle.load",
    "cPickle.loads",
    "cloudpickle.load",
    "cloudpickle.loads",
    "dill.load",
    "dill.loads",
    "joblib.load",
    "marshal.load",
    "marshal.loads",
    "yaml.unsafe_load",
    "yaml.full_load",
    "yaml.unsafe_load_all",
    "yaml.full_load_all",
    "shelve.open",
    "pandas.read_pickle",
    "pd.read_pickle",
}
NUMPY_LOADS = {"np.load", "numpy.load"}
YAML_LOADS = {"yaml.load", "yaml.load_all"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """`file:line: call` for every unpickling (or unsafe YAML) call in `source`."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> dotted origin (import pickle as p; from torch import load)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    found: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        bad = full in UNSAFE_CALLS or name in UNSAFE_CALLS
        if full in NUMPY_LOADS or name in NUMPY_LOADS:
            allow = kwargs.get("allow_pickle")
            bad = not (allow is None or (isinstance(allow, ast.Constant) and allow.value is False))
        if full in YAML_LOADS or name in YAML_LOADS:
            loader = kwargs.get("Loader", node.args[1] if len(node.args) > 1 else None)
            bad = loader is None or dotted(loader).rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS
        if bad:
            found.append(f"{filename}:{node.lineno}: {name}(...)")
    return found


def test_no_pickle_or_unsafe_yaml_on_any_load_path() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30
    found = [
        hit for f in files for hit in unsafe_loads(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))
    ]
    assert not found, "unpickling / unsafe YAML loads in rlbridge/:\n" + "\n".join(found)


def test_the_scan_catches_planted_unsafe_loads() -> None:
    planted = """
import torch, pickle as pk, numpy as np, yaml
from joblib import load as jl
torch.load("x.pt")
pk.loads(b"")
np.load("a.npy", allow_pickle=True)
jl("m.joblib")
yaml.load(text)
yaml.load(text, Loader=yaml.UnsafeLoader)
# torch.load in a comment is fine
np.load("a.npy")
np.load("a.npy", allow_pickle=False)
yaml.load(text, Loader=yaml.SafeLoader)
yaml.safe_load(text)
"""
    assert [h.split(": ", 1)[1] for h in unsafe_loads(planted)] == [
        "torch.load(...)",
        "pk.loads(...)",
        "np.load(...)",
        "jl(...)",
        "yaml.load(...)",
        "yaml.load(...)",
    ]


def ray_init_calls() -> list[tuple[str, ast.Call]]:
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and dotted(node.func) == "ray.init":
                out.append((f"{f.relative_to(ROOT)}:{node.lineno}", node))
    return out


def test_ray_dashboard_is_off_in_every_ray_init() -> None:
    calls = ray_init_calls()
    assert calls, "no ray.init found: the check would be vacuous"
    assert any(where.startswith("rlbridge/cluster/ray_cluster/") for where, _ in calls)
    for where, call in calls:
        dash = {k.arg: k.value for k in call.keywords}.get("include_dashboard")
        assert isinstance(dash, ast.Constant) and dash.value is False, (
            f"{where}: ray.init without include_dashboard=False"
        )
