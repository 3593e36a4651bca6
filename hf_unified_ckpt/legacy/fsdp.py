"""Read a legacy FSDP folder written by the Trainer/accelerate without this plugin, one tensor at a time and
without a process group:

- sharded (`pytorch_model_fsdp_0/` + `optimizer_0/`, torch.distributed.checkpoint format, from FSDP1 or FSDP2):
  each tensor is read with `torch.distributed.checkpoint.load(..., no_dist=True)` into a tensor of its full
  shape; DCP's metadata gives names, shapes and dtypes; param groups come from the pickled entries;
- full (`pytorch_model_fsdp.bin` + `optimizer.bin`, what FSDP2 writes with FULL_STATE_DICT): opened with
  `torch.load(mmap=True)`, so only the pages a tensor needs are read.

No pickled code runs: DCP's `.metadata` is unpickled allowing only its metadata classes and plain values, every
other pickle with `weights_only` (`legacy/dcp.py`, `checkpoint/pickles.py`), unless the user trusts the folder
(`trust_pickles`).

FSDP keeps its parameters in fp32 (mixed precision casts only for compute), so the model weights are also
the master weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..checkpoint.folder.files import read_json
from ..format.components import saved_by
from ..store.pickles import TRUST_OPT_IN, load_pickle
from ..errors import CorruptCheckpointError, UnifiedCheckpointError, UnsupportedCheckpointError
from ..format.names import canonical_name
from ..format.optim_state import OptimizerStateEncoder
from .sources import TensorSource

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"
MODEL_BIN, OPTIM_BIN = "pytorch_model_fsdp.bin", "optimizer.bin"


class _DCPFolder:
    """Tensor-by-tensor reads of one DCP folder, no pickled code run (`legacy/dcp.py`): tensors are asked for by
    their keys only; the few other entries (param groups) are unpickled with `weights_only`. `trust_pickles`: DCP's
    own reads (plain unpickling), for a folder the user trusts."""

    def __init__(self, path: Path, trust_pickles: bool = False):
        from torch.distributed.checkpoint import FileSystemReader

        from .dcp import RestrictedReader

        self.path, self.trusted = path, trust_pickles
        self.reader = FileSystemReader(str(path)) if trust_pickles else RestrictedReader(path)
        try:
            self.metadata = self.reader.read_metadata().state_dict_metadata
        except UnifiedCheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"{path} is not a readable torch.distributed.checkpoint folder ({e}).") from e
        self.ranks = len(list(path.glob("__*_0.distcp")))

    def tensor_keys(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {k: (tuple(m.size), m.properties.dtype) for k, m in self.metadata.items()
                if isinstance(m, TensorStorageMetadata)}

    def load(self, templates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors `templates` (key -> an empty tensor of its full shape), read into them."""
        import torch.distributed.checkpoint as dcp

        if not all(torch.is_tensor(t) for t in templates.values()):
            raise TypeError(f"{self.path}: load() reads tensors; values() reads the other entries")
        dcp.load(templates, storage_reader=self.reader, no_dist=True)
        return templates

    def values(self, keys) -> dict:
        """The non-tensor entries `keys`, unpickled with `weights_only` (DCP's `load_bytes` unpickles them whole:
        only for a trusted folder)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner

        from .dcp import WeightsOnlyPlanner

        entries = dict.fromkeys(keys)
        planner = DefaultLoadPlanner() if self.trusted else WeightsOnlyPlanner(self.path)
        dcp.load(entries, storage_reader=self.reader, planner=planner, no_dist=True)
        return entries

    def tensor(self, key: str) -> torch.Tensor:
        shape, dtype = self.tensor_keys()[key]
        return self.load({key: torch.empty(shape, dtype=dtype)})[key]


class LegacyFSDPCheckpoint:
    """Tensors of a legacy FSDP checkpoint by parameter name."""

    #: Tensor-parallel slices in separate files (`check_readable`): FSDP writes none.
    tp_size = 1

    def __init__(self, folder: str | Path, trust_pickles: bool = False):
        self.folder = Path(folder)
        if (self.folder / MODEL_DIR).is_dir():
            self.kind = "sharded"
            if not (self.folder / OPTIM_DIR).is_dir():
                raise CorruptCheckpointError(f"{self.folder} has {MODEL_DIR}/ but no {OPTIM_DIR}/.")
            self._model = _DCPFolder(self.folder / MODEL_DIR, trust_pickles)
            self._optim = _DCPFolder(self.folder / OPTIM_DIR, trust_pickles)
            self.world_size = self._model.ranks
        elif (self.folder / MODEL_BIN).is_file() and (self.folder / OPTIM_BIN).is_file():
            self.kind = "full"
            self._model_sd = _torch_load(self.folder / MODEL_BIN, trust_pickles)
            self._optim_sd = _torch_load(self.folder / OPTIM_BIN, trust_pickles)
            self.world_size = max(1, len(list(self.folder.glob("rng_state_*.pth"))))
        else:
            raise UnsupportedCheckpointError(
                f"{self.folder}: expected {MODEL_DIR}/ + {OPTIM_DIR}/ (sharded) or {MODEL_BIN} + {OPTIM_BIN} (full).")
        self.global_step = _step(self.folder)

    def topology(self) -> dict:
        return {"world_size": self.world_size, "fsdp": True}

    def saved_by(self) -> dict:
        dtypes = [d for _, (_, d, _) in self._model_entries().items()]
        return saved_by("fsdp", self.world_size, dtypes, converted_from=f"fsdp-legacy-{self.kind}")

    # ---- model --------------------------------------------------------------------------------------------
    def _model_entries(self) -> dict:
        if self.kind == "full":
            return {canonical_name(k): (tuple(v.shape), v.dtype, lambda k=k: self._model_sd[k].clone())
                    for k, v in self._model_sd.items()}
        return {canonical_name(k.removeprefix("model.")): (shape, dtype, lambda k=k: self._model.tensor(k))
                for k, (shape, dtype) in self._model.tensor_keys().items()}

    def model_source(self) -> TensorSource:
        return TensorSource(self._model_entries())

    def master_source(self) -> TensorSource:
        return self.model_source()

    # ---- optimizer ---------------------------------------------------------------------------------------
    def optimizer_source(self) -> TensorSource:
        groups, encoder = self._param_groups(), OptimizerStateEncoder()
        names = [n for g in groups for n in g["params"]]
        if self.kind == "full":
            for name, per in self._optim_sd["state"].items():
                for key, value in per.items():
                    lazy = None if not torch.is_tensor(value) else \
                        (tuple(value.shape), value.dtype, lambda n=name, k=key: self._optim_sd["state"][n][k].clone())
                    encoder.add(canonical_name(name), key, value, stored=lazy)
        else:
            prefix = "optimizer.state."
            by_length = sorted(names, key=len, reverse=True)
            for k, (shape, dtype) in self._optim.tensor_keys().items():
                rest = k[len(prefix):]
                name = next((n for n in by_length if rest.startswith(n + ".")), None)
                if not k.startswith(prefix) or name is None:
                    continue
                encoder.add(name, rest[len(name) + 1:], None, stored=(shape, dtype, lambda k=k: self._optim.tensor(k)))
        for group in groups:
            encoder.add_group(group, group["params"])
        return TensorSource.encoded(encoder)

    def _param_groups(self) -> list[dict]:
        if self.kind == "full":
            return [{**g, "params": [canonical_name(p) for p in g["params"]]} for g in self._optim_sd["param_groups"]]
        loaded = self._optim.values([k for k in self._optim.metadata if k.startswith("optimizer.param_groups.")])
        groups: dict[int, dict] = {}
        for key, value in loaded.items():
            match = re.fullmatch(r"optimizer\.param_groups\.(\d+)\.(.+)", key)
            if match:
                groups.setdefault(int(match.group(1)), {})[match.group(2)] = value
        out = [groups[i] for i in sorted(groups)]
        for g in out:
            g["params"] = [canonical_name(p) for p in g["params"]]
        return out


def _torch_load(path: Path, trust_pickles: bool = False) -> dict:
    return load_pickle(path, f"legacy FSDP file {path}", trusted=trust_pickles, opt_in=TRUST_OPT_IN,
                       map_location="cpu", mmap=True)


def _step(folder: Path) -> int:
    try:
        return int(read_json(str(folder / "trainer_state.json"), "trainer state")["global_step"])
    except (OSError, CorruptCheckpointError, ValueError, KeyError, TypeError):
        return 0
