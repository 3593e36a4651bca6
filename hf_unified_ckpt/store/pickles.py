"""The one way a pickle in a checkpoint is read: `torch.load(weights_only=True)` (tensors, plain Python values and
the classes a caller allows), refused with an error that names the file and the globals it would need; a legacy
folder the user trusts (`trust_pickles`) is unpickled whole, as the engine that wrote it would."""

from __future__ import annotations

import io
import pickle

import torch

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError

#: How a user opts in for a legacy folder they trust (named in every refusal of a legacy file).
TRUST_OPT_IN = ("If you trust this folder (your own job wrote it), opt in for it: "
                "unified_checkpoint_config=\"trust_pickles\" to resume from it, or `hf-unified-ckpt convert "
                "--trust-pickles` to convert it (docs/troubleshooting.md).")


def load_pickle(source, name: str, allowed: list = (), trusted: bool = False, opt_in: str = "", **load_kwargs):
    """`torch.load(source)` of the file `name` (a path, or the file's bytes in a `BytesIO` named by `name`) with
    `weights_only` and the globals `allowed` (as `torch.serialization.safe_globals` takes them); `trusted`: a full
    unpickle. A file that needs any other global raises `UnsupportedCheckpointError` naming the file, the globals
    and `opt_in` (the way to trust it, where there is one); a damaged one `CorruptCheckpointError`."""
    if trusted:
        try:
            return torch.load(source, weights_only=False, **load_kwargs)
        except Exception as e:  # pickle, zip and mmap errors alike
            raise CorruptCheckpointError(f"{name} cannot be read ({type(e).__name__}: {e}).") from e
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(source, weights_only=True, **load_kwargs)
        except pickle.UnpicklingError as e:  # weights_only's refusal, or a damaged pickle
            refusal = _refusal(source, name, e, opt_in)
        except Exception as e:  # zip and mmap errors, a stand-in refusing its arguments
            raise CorruptCheckpointError(f"{name} cannot be read ({type(e).__name__}: {e}).") from e
    raise refusal from None  # torch's advice (allow the global) is not the way out here


def _refusal(source, name: str, error: Exception, opt_in: str) -> Exception:
    """The error for a `weights_only` refusal of `name`: the globals it needs beyond the allowed ones (read
    statically from the pickle, nothing run), or, when it needs none, a damaged file."""
    if isinstance(source, io.IOBase):
        source.seek(0)
    try:
        unknown = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # not a torch.save zip file: damaged
        unknown = []
    if not unknown:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return CorruptCheckpointError(f"{name} cannot be read ({first}).")
    return _unsafe(name, unknown, opt_in)


def _unsafe(name: str, unknown, opt_in: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"{name} pickles {', '.join(sorted(unknown))}: unpickling that could run any code, so it is not done. "
        "Only tensors, plain Python values and known classes are read from a checkpoint's pickles"
        f"{'. ' + opt_in if opt_in else '.'}")


def vet_pickle(path, name: str, allowed_names: set[str], opt_in: str = "") -> None:
    """Refuse the `torch.save` file at `path` (`name` in errors) if its pickle needs a global outside
    `allowed_names` ("module.Class"), read statically: nothing is unpickled. For files another library then loads
    with a full unpickle (DeepSpeed's own `load_checkpoint`), which `load_pickle` never sees."""
    try:
        unknown = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - set(allowed_names)
    except Exception as e:  # not a torch.save zip file
        raise CorruptCheckpointError(f"{name} cannot be read ({type(e).__name__}: {e}).") from e
    if unknown:
        raise _unsafe(name, unknown, opt_in)
