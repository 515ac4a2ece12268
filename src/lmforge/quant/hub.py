"""`lmforge pull REPO_ID`: a model from the Hugging Face Hub, through `huggingface_hub` and its cache.

The only place lmforge downloads anything, and only when a user asks. `huggingface_hub.snapshot_download`
does the work, so its conventions hold: files land in its cache (`$HF_HUB_CACHE`, default
`~/.cache/huggingface/hub`, or `--cache-dir`), a second pull of the same revision downloads nothing,
`HF_HUB_OFFLINE=1` (or `--offline`) resolves from the cache alone, `HF_TOKEN` authenticates. By default
only what lmforge reads is fetched (config, safetensors weights, tokenizer files, chat template,
generation config); `--include` picks files instead (a GGUF repository holds one file per quantization:
`--include '*Q4_K_M.gguf'`). The result is a path that `LLM`, `serve`, `eval`, `train` and `convert`
take as they are. This module knows nothing about models.

    lmforge pull HuggingFaceTB/SmolLM2-135M-Instruct
    lmforge pull bartowski/SmolLM2-135M-Instruct-GGUF --include '*Q4_K_M.gguf'
"""

from __future__ import annotations

from pathlib import Path

MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "tokenizer.model", "vocab.json", "merges.txt"]


class PullError(RuntimeError):
    """A pull that could not complete; the message names the repository and what to do."""


def pull(repo_id: str, revision: str | None = None, include: list[str] | None = None,
         cache_dir: str | Path | None = None, offline: bool = False) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (a branch, tag or commit; default main) holding
    the files lmforge reads (or `include`'s patterns). A `.gguf` include that matches one file gives that
    file's path."""
    import huggingface_hub  # deferred: only this verb talks to the Hub
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    patterns = include or MODEL_FILES
    try:
        folder = Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, cache_dir=cache_dir,
            local_files_only=offline or huggingface_hub.constants.HF_HUB_OFFLINE))
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise PullError(f"{repo_id}: no such repository, or it needs a token (`HF_TOKEN=...`): {_first_line(e)}") \
            from None
    except RevisionNotFoundError:
        raise PullError(f"{repo_id}: no revision {revision!r}; pass a branch, tag or commit that exists") from None
    except LocalEntryNotFoundError:
        raise PullError(f"{repo_id}{'@' + revision if revision else ''}: not in the cache "
                        f"({cache_dir or huggingface_hub.constants.HF_HUB_CACHE}) and offline "
                        "(HF_HUB_OFFLINE=1 or --offline); pull it once online") from None
    except ValueError as e:  # huggingface_hub's own refusals (a malformed repo id, ...)
        raise PullError(f"{repo_id}: {_first_line(e)}") from None
    return _model_path(folder, repo_id, include)


def _model_path(folder: Path, repo_id: str, include: list[str] | None) -> Path:
    ggufs = sorted(folder.rglob("*.gguf"))
    if include and len(ggufs) == 1:
        return ggufs[0]
    if (folder / "config.json").is_file() or ggufs:
        return folder
    raise PullError(f"{repo_id}: the snapshot at {folder} has no config.json and no .gguf file "
                    f"({'--include ' + ' '.join(include) if include else 'the default files'} matched none); "
                    "is it a model repository? pick files with --include")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
