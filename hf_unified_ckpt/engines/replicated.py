"""Single process and DDP: every rank holds the full model and optimizer state, so every rank can write any
file; the plan spreads files over ranks, and loading reads whole tensors locally."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from .. import dist
from ..format.components import MASTER, MODEL, OPTIMIZER, Component, saved_by
from ..errors import UnsupportedCheckpointError, missing_and_unexpected
from .hf_model import is_peft_model, live_model_state, naming_policy, parameter_names, model_config_files
from ..format.optim_state import flatten_optimizer_state, unflatten_optimizer_state
from ..format.planning import TensorSpec
from ..format.reader import TensorReader
from .base import Fragment, component_source


class ReplicatedEngine:
    """Adapter for a model replicated on every rank (no process group, or DDP)."""

    #: The weights are applied by the module's own `load_state_dict` (`load_model`), which judges their shapes.
    loads_by_module = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.module = extract_model_from_parallel(model)
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        self.engine = "ddp" if dist.world_size() > 1 else "single"
        self.naming = naming_policy(self.module)
        self._model_state = live_model_state(self.module, self.naming)
        self._names = parameter_names(self.module, self.naming)
        self._optim: tuple[dict, dict] | None = None
        self._sources = {MODEL.name: lambda: self._model_state, OPTIMIZER.name: lambda: self._optimizer_flat()[0]}

    def saved_by(self) -> dict:
        return saved_by(self.engine, dist.world_size(), [p.dtype for p in self.module.parameters()])

    def needs_fp32_master(self) -> bool:
        """fp32 trainable parameters need fp32 values on load."""
        return any(p.requires_grad and p.dtype == torch.float32 for p in self.module.parameters())

    def components(self) -> list[Component]:
        return [self.naming.weights, OPTIMIZER]

    def _source(self, component: str) -> dict:
        return component_source(self._sources, component, self.engine)()

    def preferred_owners(self, component: str) -> dict[str, int]:
        return {}  # every rank holds everything

    def exchange(self, component: str, names, owner: int) -> None:
        """Nothing to assemble: every rank holds every tensor."""

    def _optimizer_flat(self) -> tuple[dict, dict]:
        if self._optim is None:
            if self.optimizer is None:
                self._optim = ({}, {"param_groups": [], "state_types": {}})
            else:
                index_to_name = dict(enumerate(self._param_name(p) for g in self.optimizer.param_groups
                                               for p in g["params"]))
                self._optim = flatten_optimizer_state(self.optimizer.state_dict(), index_to_name)
        return self._optim

    def _param_name(self, param: torch.Tensor) -> str:
        try:
            return self._names[id(param)]
        except KeyError:
            raise UnsupportedCheckpointError(
                f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a parameter of the model; "
                "unified checkpoints key optimizer state by parameter name."
            ) from None

    def specs(self, component: str) -> list[TensorSpec]:
        return [TensorSpec.of(n, t) for n, t in self._source(component).items()]

    def tensors(self, component: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        source = self._source(component)
        return {n: source[n] for n in names}

    def fragments(self, component: str, names: Sequence[str] | None = None) -> dict[str, Fragment]:
        """None: every rank holds every tensor whole."""
        return {}

    def partition_rule(self, component: str, names=None) -> tuple[dict, str]:
        """Nothing is split over the ranks: the closed form of `fragments` is empty. Local."""
        return {}, "replicated"

    def parameter_rule(self) -> tuple[dict, str]:
        """Every parameter is whole on every rank. Local."""
        return {}, "replicated"

    def optimizer_metadata(self) -> dict:
        return self._optimizer_flat()[1]

    def parameter_fragments(self) -> dict:
        """Every trainable parameter, whole (every rank holds it), as `Fragment`s. Local only."""
        return {self.naming.weight_key(n) or self._names[id(p)]: Fragment(tuple(p.shape), 0, p.detach().reshape(-1),
                                                                          replicated=True)
                for n, p in self.module.named_parameters() if p.requires_grad}

    def config_files(self) -> dict[str, bytes]:
        return model_config_files(self.module)

    # ---- load -------------------------------------------------------------------------------------------
    def load(self, sources) -> None:
        """Load from `sources` (a `load.LoadSources`); local only."""
        self.load_model(sources.get(MODEL), sources.get(MASTER))
        if sources.get(OPTIMIZER) is not None:
            self.load_optimizer(sources.get(OPTIMIZER))

    def load_model(self, reader: TensorReader, master: TensorReader | None = None) -> None:
        """Weights from `reader`; fp32 trainable parameters from `master` (exact fp32 values) when given. Applied
        by the module's own `load_state_dict`, as the native Trainer's resume and best-model load do (a module
        that overrides it, e.g. to take a buffer of another shape, gets what it expects). Unlike native, which
        loads with `strict=False` and only warns, missing or unexpected keys are refused (the checkpoint is of
        another model)."""
        if is_peft_model(self.module):
            return self._load_adapter(reader)
        names = list(self.module.state_dict())
        fp32_trainable = {self._names[id(p)] for p in self.module.parameters() if p.requires_grad
                          and p.dtype == torch.float32}
        sources = {name: self.naming.stored_key(name) for name in names}
        missing = sorted({s for s in sources.values() if s not in reader})
        unexpected = sorted(set(reader.keys()) - set(sources.values()))
        if missing or unexpected:
            raise UnsupportedCheckpointError(
                f"the checkpoint's model weights do not match the model: {missing_and_unexpected(missing, unexpected)}. "
                "Build the same architecture (config) as the run that saved it."
            )
        state = {name: (master if master is not None and src in fp32_trainable and src in master else reader).get(src)
                 for name, src in sources.items()}
        try:
            self.module.load_state_dict(state, strict=False)
        except RuntimeError as e:
            raise UnsupportedCheckpointError(
                f"the model's load_state_dict refused the checkpoint's weights: {e}. Build the same architecture "
                "(config) as the run that saved it.") from e

    def _load_adapter(self, reader: TensorReader) -> None:
        from peft import set_peft_model_state_dict

        expected, found = set(self._model_state), set(reader.keys())
        if expected != found:
            raise UnsupportedCheckpointError(
                f"the checkpoint's adapter weights do not match the PEFT model: "
                f"{missing_and_unexpected(sorted(expected - found), sorted(found - expected))}. "
                "Use the same LoRA configuration as the run that saved it."
            )
        set_peft_model_state_dict(self.module, {k: reader.get(k) for k in reader.keys()})

    def param_group_names(self) -> list[list[str]]:
        """The parameter names of each of the optimizer's param groups, in its order. Local only."""
        return [[self._param_name(p) for p in g["params"]] for g in self.optimizer.param_groups]

    def load_optimizer(self, reader: TensorReader) -> None:
        current = self.param_group_names()
        state = unflatten_optimizer_state(reader, current, self.optimizer.param_groups)
        self.optimizer.load_state_dict(state)
        self._optim = None

