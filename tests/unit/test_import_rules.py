"""The import rules of ARCHITECTURE.md, read from the source (no imports run):

- each heavy dependency is imported in one place (ruff's TID251 checks the same, but its per-file exemption lifts
  the ban on every library at once: a megatron module could import vLLM unnoticed; this test cannot be fooled so);
- no import cycle among rlbridge's modules through module-level imports (imports inside functions are the
  sanctioned way to defer a heavy or late dependency and are left out);
- the layers of the data flow (LAYERS): what rollout/ and algo/ share with the trainer engines lives in neutral
  packages (weights/, model/, batch.py), not in engines/; weights/ sits below both sides; the run directory does
  not know the plan; data/ does not reach into run/; the driver's health checks do not reach the workers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "rlbridge"

ALLOWED = {  # library -> the files (relative to rlbridge/) that may import it
    "vllm": ("rollout/vllm.py",),
    "ray": ("cluster/ray_cluster/",),
    "megatron": ("engines/megatron/",),
    "mbridge": ("engines/megatron/",),
    "transformers": ("model/hf.py",),
    "peft": ("model/hf.py",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, top_level_only: bool) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks import nothing at run time
        nodes = [n for n in nodes if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    out: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [
                f"{node.module}.{a.name}" for a in node.names
            ]  # `from rlbridge.x import y` may be a module
    return out


def test_each_heavy_library_is_imported_in_its_one_place() -> None:
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for name in imports(path, top_level_only=False):
            lib = name.split(".")[0]
            if lib in ALLOWED and not any(
                rel == a or (a.endswith("/") and rel.startswith(a)) for a in ALLOWED[lib]
            ):
                wrong.append(f"{rel} imports {name} (allowed only in {', '.join(ALLOWED[lib])})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_through_module_level_imports() -> None:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    # an edge to one's own parent package is left out: importing rlbridge.cli.export runs rlbridge/cli/__init__.py
    # first whatever it names, so `from rlbridge.cli import common` inside the package is no cycle
    graph = {
        m: sorted(
            {
                n
                for n in imports(p, top_level_only=True)
                if n in modules and n != m and not m.startswith(n + ".")
            }
        )
        for m, p in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


LAYERS = (  # (files under rlbridge/, packages or modules they must not import at all, why)
    (
        "rollout/",
        ("rlbridge.engines",),
        "rollout engines share only weights/, model/ and batch.py with the trainer",
    ),
    ("algo/", ("rlbridge.engines",), "the algorithm hands engines closures typed in batch.py"),
    ("weights/", ("rlbridge.engines", "rlbridge.rollout"), "weights/ is what both sides import"),
    ("run/directory.py", ("rlbridge.plan",), "the run directory takes the plan as JSON data"),
    ("data/", ("rlbridge.run",), "fault points are rlbridge/faults.py"),
    (
        "health.py",
        ("rlbridge.session", "rlbridge.cluster", "rlbridge.trainer", "rlbridge.rollout"),
        "the checks after an update read its metrics, the recipe and the plan, never the workers",
    ),
)


def test_layers_import_only_downwards() -> None:
    """Every import counts here, inside functions and under TYPE_CHECKING too: a layer that needs another's type
    needs the type moved."""
    wrong = []
    for where, banned, why in LAYERS:
        paths = sorted((PKG / where).rglob("*.py")) if where.endswith("/") else [PKG / where]
        assert paths and all(p.exists() for p in paths), where
        for path in paths:
            for name in imports(path, top_level_only=False):
                if any(name == b or name.startswith(b + ".") for b in banned):
                    wrong.append(f"{path.relative_to(PKG).as_posix()} imports {name} ({why})")
    assert not wrong, "\n".join(wrong)


def test_the_rules_see_imports() -> None:
    """The checks above would pass vacuously if the parsing found nothing."""
    assert "vllm" in {n.split(".")[0] for n in imports(PKG / "rollout" / "vllm.py", top_level_only=False)}
    assert "rlbridge.model.hf" in imports(PKG / "engines" / "hf" / "engine.py", top_level_only=True)
    assert "rlbridge.weights.WeightExport" in imports(PKG / "rollout" / "base.py", top_level_only=False)


SPEC_MODULES = (
    "engines/spec.py",
    "engines/registry.py",
    "engines/hf/spec.py",
    "engines/megatron/spec.py",
    "rollout/spec.py",
    "rollout/registry.py",
    "rollout/vllm_spec.py",
    "rollout/hf_spec.py",
)
SPEC_MAY_IMPORT = ("rlbridge.engines.spec", "rlbridge.rollout.spec", "rlbridge.errors") + tuple(
    "rlbridge." + m.removesuffix(".py").replace("/", ".") for m in SPEC_MODULES
)


def test_engine_specs_import_no_engine_and_no_recipe_at_module_level() -> None:
    """The engine specs are read by recipe validation and `rlbridge plan` (which import no torch), and the recipe
    checks import them: at module level a spec imports other specs, errors and the standard library only (its
    engine, torch and the recipe's types come inside functions or under TYPE_CHECKING). Importing
    rlbridge.recipe.schema would run rlbridge/recipe/__init__.py, whose checks import the registry back."""
    wrong = []
    for rel in SPEC_MODULES:
        for name in imports(PKG / rel, top_level_only=True):
            if name.split(".")[0] in ALLOWED or name == "torch" or name.startswith("torch."):
                wrong.append(f"{rel} imports {name}")
            elif name.startswith("rlbridge.") and not any(
                name == m or name.startswith(m + ".") for m in SPEC_MAY_IMPORT
            ):
                wrong.append(f"{rel} imports {name}")
    assert not wrong, "\n".join(wrong)
