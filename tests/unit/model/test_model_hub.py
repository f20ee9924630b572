"""model.path as a Hugging Face Hub id, resolved offline from a Hub-layout cache the test builds.

The cache is the one huggingface_hub writes (`hub/models--org--name/snapshots/<commit>/`, `refs/main`), holding a
tiny random Llama saved with transformers; HF_HOME points at tmp_path and the Hub is offline, so nothing here can
reach a network. One test runs the CLI in a subprocess to prove the real environment variables are followed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlbridge.cli import app
from rlbridge.errors import RlbridgeError
from rlbridge.model import hub
from rlbridge.model.cache import ensure_model
from rlbridge.model.info import read_model_info, resolve_model_path
from tests.fixtures.tiny_llama import build_tiny_llama

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "89abcdef0123456789abcdef0123456789abcdef"
runner = CliRunner()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


def _snapshot(hub_dir: Path, repo: str, commit: str, files: Path, ref: str = "main") -> Path:
    """A snapshot as huggingface_hub lays it out (files are copies here, blobs + symlinks there: both load)."""
    root = hub_dir / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in files.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hf_home(tmp_path: Path, model_files: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME = tmp_path/hf with the tiny model cached at main and at the tag v1 (config changed), offline."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the environment once, at import: this process imported it already
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _snapshot(home / "hub", REPO, COMMIT, model_files)
    tagged = _snapshot(home / "hub", REPO, TAGGED, model_files, ref="v1")
    cfg = json.loads((tagged / "config.json").read_text())
    (tagged / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    return home


def _recipe(tmp_path: Path, **model: object) -> Path:
    raw = yaml.safe_load(Path("recipes/quickstart.yaml").read_text())
    raw["model"] = {"dtype": "float32", **model}
    raw["lora"]["rank"] = 4
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_hub_id_resolves_to_its_cached_snapshot(hf_home: Path) -> None:
    snap = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots"
    assert resolve_model_path(REPO) == snap / COMMIT
    assert resolve_model_path(REPO, "v1") == snap / TAGGED
    assert ensure_model(REPO) == snap / COMMIT  # the training driver's: complete, nothing fetched
    assert read_model_info(REPO).layers == 2 and read_model_info(REPO, "v1").layers == 4
    from rlbridge.model.tokenizer import load_tokenizer

    assert load_tokenizer(ensure_model(REPO)).eos_token_id is not None  # transformers loads the snapshot


def test_validate_and_plan_take_a_hub_id(hf_home: Path, tmp_path: Path) -> None:
    path = _recipe(tmp_path, path=REPO)
    res = runner.invoke(app, ["validate-recipe", str(path)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["plan", str(path), "--json"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["validate-recipe", str(path), "--set", "model.revision=v1"])
    assert res.exit_code == 0, res.output


def test_an_id_missing_offline_names_the_fetch_command(hf_home: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["validate-recipe", str(_recipe(tmp_path, path="other-org/missing-model"))])
    assert res.exit_code == 2
    out = " ".join(res.output.split())
    assert "huggingface-cli download other-org/missing-model" in out and "hf download" in out
    assert "HF_HUB_OFFLINE" in out and "model.path" in out and "Traceback" not in out
    with pytest.raises(RlbridgeError, match="huggingface-cli download other-org/missing-model"):
        ensure_model("other-org/missing-model")
    res = runner.invoke(app, ["validate-recipe", str(_recipe(tmp_path, path=REPO, revision="v9"))])
    assert res.exit_code == 2 and "--revision v9" in " ".join(res.output.split())


def test_a_revision_needs_a_hub_id(hf_home: Path, tmp_path: Path, model_files: Path) -> None:
    res = runner.invoke(
        app, ["validate-recipe", str(_recipe(tmp_path, path=str(model_files), revision="v1"))]
    )
    assert res.exit_code == 2 and "model.revision" in res.output


def test_a_local_directory_wins_over_a_hub_id(hf_home: Path, tmp_path: Path, model_files: Path) -> None:
    local = tmp_path / "tiny-org" / "tiny-llama"
    local.parent.mkdir()
    local.symlink_to(model_files)
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert resolve_model_path(REPO) == Path(REPO)
    finally:
        os.chdir(cwd)
    assert hub.is_hub_id(REPO) and not hub.is_hub_id("/abs/dir") and not hub.is_hub_id("a/b/c")
    assert not hub.is_hub_id("./rel") and not hub.is_hub_id("smollm2-135m-instruct")


def test_weights_missing_from_the_cache_are_an_error(
    hf_home: Path, tmp_path: Path, model_files: Path
) -> None:
    snap = _snapshot(hf_home / "hub", "tiny-org/config-only", COMMIT, model_files)
    (snap / "model.safetensors").unlink()
    with pytest.raises(RlbridgeError, match="no .safetensors weights"):
        ensure_model("tiny-org/config-only")


def test_cli_follows_hf_home_and_hf_hub_offline(hf_home: Path, tmp_path: Path) -> None:
    """The real environment, read by a fresh process: HF_HOME finds the cache, HF_HUB_OFFLINE keeps it local."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())}
    env.pop("HF_HUB_CACHE", None)
    args = [sys.executable, "-m", "rlbridge", "validate-recipe"]
    ok = subprocess.run([*args, str(_recipe(tmp_path, path=REPO))], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run(
        [*args, str(_recipe(tmp_path, path="tiny-org/absent"))], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "hf download tiny-org/absent" in " ".join(
        (bad.stdout + bad.stderr).split()
    )
