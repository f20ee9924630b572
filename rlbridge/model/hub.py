"""Hugging Face Hub ids as `model.path`: `org/name` (and `model.revision`) found in the Hub's local cache.

huggingface_hub does all the Hub work: its cache layout (`models--org--name/snapshots/<commit>/`, `refs/`),
`HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, and the token from `HF_TOKEN` or `hf auth login`. rlbridge never
reads or stores the token; the run directory keeps the id and the revision, as the recipe wrote them.

Two ways in:
- `cached_file` / `cached_snapshot`: the cache only, no network (validation, the workers: the driver has
  fetched the model before they start);
- `fetch_snapshot`: the training driver's, which downloads what the cache lacks unless the Hub is offline.

Anything missing is an `RlbridgeError` that names the command fetching the model.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlbridge.errors import RlbridgeError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
"""What `fetch_snapshot` downloads: configs, tokenizer files, chat templates and safetensors weights (not the
.bin / .onnx / .gguf copies many repositories carry besides)."""


def is_hub_id(path: str) -> bool:
    """`org/name` as the Hub spells repository ids (a path that exists locally is a path, checked first by the
    caller)."""
    return bool(_ID.match(path)) and ".." not in path


def fetch_command(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"huggingface-cli download {repo_id}{rev} (or: hf download {repo_id}{rev})"


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _missing(repo_id: str, revision: str | None, what: str, why: str = "") -> RlbridgeError:
    where = "offline (HF_HUB_OFFLINE)" if _offline() else "the Hub was not reached"
    return RlbridgeError(
        f"model.path {repo_id!r}{f' (revision {revision})' if revision else ''}: {what} not in the Hugging Face "
        f"cache ({_cache_dir()}) and {where}{f': {why}' if why else ''}. Fetch it with: "
        f"{fetch_command(repo_id, revision)}; or point model.path at a local model directory"
    )


def _hub_error(repo_id: str, revision: str | None, e: Exception) -> RlbridgeError:
    from huggingface_hub import errors

    rev = f" (revision {revision})" if revision else ""
    if isinstance(e, errors.GatedRepoError):
        return RlbridgeError(
            f"model.path {repo_id!r}: a gated repository; accept its terms on huggingface.co and log in "
            "(hf auth login, or set HF_TOKEN)"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return RlbridgeError(
            f"model.path {repo_id!r}: no such model on the Hub (or a private one: log in with hf auth login or "
            "set HF_TOKEN); a local directory needs a path that exists"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return RlbridgeError(
            f"model.revision {revision!r}: {repo_id} has no such branch, tag or commit; set model.revision to "
            "one it has (or remove it for main)"
        )
    if isinstance(e, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled):
        return _missing(repo_id, revision, "not completely")
    return RlbridgeError(f"model.path {repo_id!r}{rev}: the Hugging Face Hub failed: {e}")


def cached_file(repo_id: str, revision: str | None, filename: str, *, download: bool = False) -> Path:
    """One file of the model (e.g. config.json): from the cache, or (download=True, online) from the Hub."""
    from huggingface_hub import errors, hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=True))
    except errors.LocalEntryNotFoundError:
        if not download or _offline():
            raise _missing(repo_id, revision, filename) from None
    except errors.HFValidationError as e:
        raise RlbridgeError(f"model.path {repo_id!r} is not a valid Hub id: {e}") from None
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except errors.LocalEntryNotFoundError:  # not cached, and the Hub did not answer
        raise _missing(repo_id, revision, filename) from None
    except errors.RemoteEntryNotFoundError:
        raise RlbridgeError(f"model.path {repo_id!r}: the repository has no {filename}") from None
    except (errors.HfHubHTTPError, OSError, errors.OfflineModeIsEnabled) as e:
        raise _hub_error(repo_id, revision, e) from None


def cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """The cached snapshot directory of the model (no network): what the workers load."""
    from huggingface_hub import errors, snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except errors.LocalEntryNotFoundError:
        raise _missing(repo_id, revision, "the model") from None
    except errors.HFValidationError as e:
        raise RlbridgeError(f"model.path {repo_id!r} is not a valid Hub id: {e}") from None


def fetch_snapshot(repo_id: str, revision: str | None, log: object = None) -> Path:
    """The model's snapshot directory, downloaded first where the cache lacks files and the Hub is online.

    The directory must hold config.json and safetensors weights: rlbridge loads nothing else."""
    from huggingface_hub import errors, snapshot_download

    try:
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=MODEL_FILES, local_files_only=_offline()
            )
        )
    except errors.HFValidationError as e:
        raise RlbridgeError(f"model.path {repo_id!r} is not a valid Hub id: {e}") from None
    except errors.LocalEntryNotFoundError:
        raise _missing(repo_id, revision, "the model") from None
    except (errors.HfHubHTTPError, errors.OfflineModeIsEnabled, OSError) as e:
        raise _hub_error(repo_id, revision, e) from None
    if not (folder / "config.json").is_file():
        raise _missing(repo_id, revision, "config.json")
    if not any(folder.glob("*.safetensors")):
        raise RlbridgeError(
            f"model.path {repo_id!r}: no .safetensors weights in {folder} (rlbridge loads safetensors only). "
            f"Fetch them with: {fetch_command(repo_id, revision)}, or convert the model and point model.path at "
            "the local directory"
        )
    return folder
