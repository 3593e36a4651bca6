"""The folder a trainer class's own `_save_checkpoint` writes into during a unified save (`HookFolder`): while the
class's chain runs, `trainer._get_output_dir(trial)` resolves to this save's hook root, a hidden folder of this save's
own next to the run's checkpoints (`.checkpoint-N.hooks.<host>.<pid>.<token>.incomplete`: a staging name, which a
later save's clean-up removes once this process is gone), and its `checkpoint-N` is where the class's code writes. When the
outermost `_save_checkpoint` ends, the files there are taken into the save as small files (listed in the manifest,
verified, copied with it wherever it goes) and the folder is removed."""

from __future__ import annotations

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import dist
from ..checkpoint.folder.commit import COMMIT_FILE, new_tag
from ..errors import UnsupportedCheckpointError
from ..store import STAGING_SUFFIX, is_file, join, store_for


class HookFolder:
    """One save's hook folder on this rank (see the module docstring). `root` is what `_get_output_dir` returns
    while the chain runs; `folder` (`root/checkpoint-N`) holds what the chain writes."""

    def __init__(self, output_dir: str, step: int):
        self.step = step
        self.root = join(output_dir, f".{PREFIX_CHECKPOINT_DIR}-{step}.hooks.{new_tag()}{STAGING_SUFFIX}")
        self.folder = join(self.root, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        #: The real `checkpoint-N` of the native output folder, and whether it was there before the chain ran.
        self.native = join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self.native_existed = store_for(self.native).is_folder(self.native)
        store_for(self.folder).make_folder(self.folder)

    def files(self, owner: str) -> dict[str, bytes]:
        """The files the chain wrote (name -> bytes). A sub-folder is refused (a unified checkpoint holds plain files
        only), naming `owner` (the trainer class)."""
        self._refuse_native_writes(owner)
        store = store_for(self.folder)
        listed = store.list(self.folder) if store.is_folder(self.folder) else {}
        folders = sorted(name for name, size in listed.items() if size is None)
        if folders:
            raise UnsupportedCheckpointError(
                f"{owner}._save_checkpoint wrote the folder(s) {folders} into {PREFIX_CHECKPOINT_DIR}-{self.step}; a "
                "unified checkpoint holds plain files only, so they cannot be part of it. Write files, not folders "
                "(or train without unified_checkpoint). Nothing of this save was committed; earlier checkpoints are "
                "untouched.")
        return {name: store.read(join(self.folder, name)) for name in sorted(listed)}

    def _refuse_native_writes(self, owner: str) -> None:
        """A `checkpoint-N` folder that appeared in the native output folder while the chain ran, without a manifest:
        the class wrote into a path it built otherwise (from `args.output_dir`), which the save would replace
        without a word; refused, naming `owner`."""
        store = store_for(self.native)
        if not self.native_existed and store.is_folder(self.native) and not is_file(join(self.native, COMMIT_FILE)):
            raise UnsupportedCheckpointError(
                f"{owner}._save_checkpoint wrote into {self.native} by a path it did not get from "
                "self._get_output_dir(trial) (built from args.output_dir?); with unified_checkpoint=True that folder "
                "is written by the save and the files there would be lost. Build the folder as "
                "os.path.join(self._get_output_dir(trial), f'checkpoint-{self.state.global_step}'), as transformers "
                "and TRL do: what is written there is part of the checkpoint. Nothing of this save was committed; "
                "earlier checkpoints are untouched.")

    def remove(self) -> None:
        store = store_for(self.root)
        if store.is_folder(self.root):
            store.remove(self.root)


def is_reserved(name: str, small: dict) -> bool:
    """Whether the plugin writes a file of this name itself into a checkpoint of which `small` are this rank's small
    files: one of those, the manifest, a tensor file or its index, a hidden name (its writer marks)."""
    return (name in small or name == COMMIT_FILE or name.startswith(".") or name.endswith(".safetensors")
            or name.endswith(".safetensors.index.json"))


def shared_hook_files(files: dict[str, bytes], small: dict) -> dict[str, bytes]:
    """This rank's hook files that are its to write: not one the plugin writes itself (`is_reserved`: its own win,
    as the base Trainer's write came first natively) and not one a lower rank also wrote (in a folder every rank
    shares, natively one file). Collective: all ranks call it."""
    mine = {n: data for n, data in files.items() if not is_reserved(n, small)}
    names = dist.all_gather_object(sorted(mine))
    lower = {n for rank_names in names[:dist.rank()] for n in rank_names}
    return {n: data for n, data in mine.items() if n not in lower}
