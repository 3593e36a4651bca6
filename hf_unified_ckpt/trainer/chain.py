"""Where the plugin sits in a Trainer's class hierarchy, so that the class's own `_save_checkpoint` and load hooks
run (TRL's trainers, a user's subclass) and only the base `transformers.Trainer`'s native writes and reads are
replaced:

- `NativeStandIn`, a `transformers.Trainer` subclass placed just above `transformers.Trainer` in the method
  resolution order (below every class of the trainer's own), stands for the base Trainer's `_save_checkpoint`,
  `_load_optimizer_and_scheduler`, `_load_from_checkpoint` and `_load_rng_state`: a subclass's
  `super()._save_checkpoint(model, trial)` reaches it, and the unified save is planned there in place of the native
  write (`CheckpointSession.save_base`); the loads of a folder the plugin loaded itself do nothing there;
- `Outermost`, first in the resolution order, is the outermost `_save_checkpoint`: it runs the class's whole chain
  with `_get_output_dir` resolving into this save's own hook folder (`checkpoint.hook_files`), then writes the save,
  the files the chain wrote there included (`CheckpointSession.save`);
- `chained(cls)`: the class a trainer of class `cls` is switched to (made once per class). No method of
  `transformers.Trainer` or of any other class is changed: the two classes are ordinary bases of the new one (C3
  linearisation puts `NativeStandIn` last before `transformers.Trainer`)."""

from __future__ import annotations

import transformers


class NativeStandIn(transformers.Trainer):
    """The base Trainer's checkpoint methods as the plugin replaces them (see the module docstring). Each hands the
    call to the trainer's `CheckpointSession`, with the base Trainer's own method where the plugin is off or the
    folder is not one it loaded."""

    def _save_checkpoint(self, model, trial):
        """Collective: all ranks call it."""
        return self._uc_session.save_base(super()._save_checkpoint, model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        return self._uc_session.load_optimizer_and_scheduler(super()._load_optimizer_and_scheduler, checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return self._uc_session.load_from_checkpoint(super()._load_from_checkpoint, resume_from_checkpoint, model)

    def _load_rng_state(self, checkpoint):
        return self._uc_session.load_rng_state(super()._load_rng_state, checkpoint)


class Outermost:
    """The outermost `_save_checkpoint` and the `_get_output_dir` the chain sees (see the module docstring)."""

    def _save_checkpoint(self, model, trial):
        """The class's own `_save_checkpoint` chain, then the unified save. Collective: all ranks call it."""
        return self._uc_session.save(super()._save_checkpoint, model, trial)

    def _get_output_dir(self, trial):
        return self._uc_session.output_dir(super()._get_output_dir, trial)


def overrides_save(cls: type) -> bool:
    """Whether a class of `cls`'s own (not the plugin's, not `transformers.Trainer`) defines `_save_checkpoint`."""
    return save_owner(cls) is not None


def save_owner(cls: type) -> str | None:
    """The name of the outermost class of `cls`'s own (not the plugin's, not `transformers.Trainer`) defining
    `_save_checkpoint` (what messages name); None when none does."""
    return next((c.__name__ for c in cls.__mro__ if "_save_checkpoint" in vars(c)
                 and c not in (Outermost, NativeStandIn, transformers.Trainer)), None)


_CHAINED: dict[tuple[type, type | None], type] = {}


def chained(cls: type, mixin: type | None = None) -> type:
    """`cls` with `Outermost` first (then `mixin`, when given) and `NativeStandIn` just above `transformers.Trainer`
    in its resolution order, named `name`; made once per class. `cls` already chained is returned as it is."""
    if issubclass(cls, NativeStandIn):
        return cls
    key = (cls, mixin)
    if key not in _CHAINED:
        own = () if cls is transformers.Trainer else (cls,)
        bases = (Outermost, *(() if mixin is None else (mixin,)), *own, NativeStandIn)
        name = f"Unified{cls.__name__}" if mixin is not None else cls.__name__
        _CHAINED[key] = type(name, bases, {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                           "__qualname__": name})
    return _CHAINED[key]
