"""Reading safetensors checkpoints: one file or shards listed in an index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.common.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder, in a stable order.

    Raises:
        CheckpointError: neither `model.safetensors` nor an index is present, or a shard
            named by the index is missing.
    """
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index_path} names missing shard(s): {', '.join(missing)}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise CheckpointError(
        f"model folder {model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} "
        "(only safetensors checkpoints are supported)"
    )


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one shard open at a time."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, shard.get_tensor(name)
