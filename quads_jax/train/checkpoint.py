"""Orbax checkpoints of the train state: async save every N steps, keep K, exact resume.

A checkpoint of step ``s`` holds two items: ``state`` (the :class:`TrainState` pytree: params,
optimizer state, step, RNG, non-finite counters) and ``meta`` (JSON: the data position, the RL
step, the config, anything the loop needs to continue exactly).

Atomicity: Orbax writes into a temporary ``<step>.orbax-checkpoint-tmp-*`` folder and renames
it when complete; on top of that the ``meta`` item carries ``"complete": true`` and a step
folder without a readable, complete ``meta`` is never returned as the latest (a copy cut off
mid-write, or a folder someone half-deleted, falls back to the previous good step).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from quads_jax.config import check


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When and how many checkpoints.

    Attributes:
      every_steps: save every this many RL steps (and at the end); 0 saves only at the end.
      keep: how many recent checkpoints to keep.
      async_save: write in a background thread while training continues.
      resume: continue from the latest complete checkpoint in the run directory if any.
    """

    every_steps: int = 10
    keep: int = 2
    async_save: bool = True
    resume: bool = True

    def __post_init__(self) -> None:
        check("CheckpointConfig", "every_steps", self.every_steps, self.every_steps >= 0,
              "an integer >= 0")
        check("CheckpointConfig", "keep", self.keep, self.keep >= 1, "an integer >= 1")


class Checkpointer:
    """A thin owner of one ``ocp.CheckpointManager`` under ``directory``."""

    def __init__(self, directory: str, config: CheckpointConfig):
        self.directory = os.path.abspath(directory)
        self.config = config
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            create=True,
            enable_async_checkpointing=config.async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def should_save(self, step: int, *, last: bool = False) -> bool:
        every = self.config.every_steps
        return last or (every > 0 and step % every == 0)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start saving ``state`` (a pytree of arrays) and ``meta`` (JSON) as ``step``."""
        meta = dict(meta, complete=True, step=int(step))
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self._manager.wait_until_finished()

    def _is_complete(self, step: int) -> bool:
        root = os.path.join(self.directory, str(step))
        # Orbax's own commit markers (written last) plus our meta flag; any one missing means
        # the folder is not a finished checkpoint.
        markers = ("commit_success.txt", "state/commit_success.txt", "state/_METADATA")
        if not all(os.path.exists(os.path.join(root, m)) for m in markers):
            return False
        try:
            with open(os.path.join(root, "meta", "metadata")) as f:
                return bool(json.load(f).get("complete"))
        except (OSError, ValueError):
            return False

    def complete_steps(self) -> list[int]:
        """The steps whose checkpoints are complete, oldest first."""
        self._manager.reload()
        return [s for s in sorted(self._manager.all_steps()) if self._is_complete(s)]

    def latest_step(self) -> int | None:
        """The newest step whose checkpoint is complete, or None."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``(state, meta)`` of ``step``; ``abstract_state`` gives shapes, dtypes and
        shardings (arrays or ``jax.ShapeDtypeStruct`` with ``.sharding``)."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            abstract_state,
        )
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                    meta=ocp.args.JsonRestore()),
        )
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
