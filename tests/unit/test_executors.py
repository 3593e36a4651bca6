"""Where a background save runs after its snapshot (`checkpoint/save/executors.py`): the writer process writes the same
bytes as the thread, from the same shared host buffers, and a writer that dies is a typed error at the next wait,
never a hang (world size 2: `test_async_save.py::test_async_resume_is_exact_on_every_engine`)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from hf_unified_ckpt.checkpoint.save.async_save import AsyncSaver
from hf_unified_ckpt.checkpoint.save.executors import Executor, executor_for
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout
from hf_unified_ckpt.checkpoint.save.saving import SaveRequest
from hf_unified_ckpt.engines.replicated import ReplicatedEngine
from hf_unified_ckpt.errors import WriterProcessDied
from hf_unified_ckpt.options import ASYNC_EXECUTORS, UnifiedCheckpointOptions

OPTIONS = UnifiedCheckpointOptions(enabled=True, max_shard_size=3000)


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 53), nn.Linear(53, 11))  # sizes that split unevenly into files
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 37)).sum().backward()
    opt.step()
    return ReplicatedEngine(model, opt)


def _save(saver: AsyncSaver, engine, final: str, step: int) -> str:
    saver.start(engine, SaveRequest(final, step, OPTIONS, show_progress=False), {"trainer_state.json": b"{}"})
    saver.wait()
    return final


def _files(folder: str) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def test_the_writer_process_writes_what_the_thread_writes_from_shared_buffers(tmp_path):
    engine = _engine()
    thread, process = AsyncSaver("thread"), AsyncSaver("process")
    try:
        for step in (1, 2):  # the second save reuses the buffers and the writer process
            a = _save(thread, engine, str(tmp_path / "thread" / f"checkpoint-{step}"), step)
            b = _save(process, engine, str(tmp_path / "process" / f"checkpoint-{step}"), step)
            assert _files(a) == _files(b) and len(_files(b)) > 3
            assert detect_layout(b).complete
        held = process._snapshots.buffers._buffers.values()
        assert held and all(buffer.is_shared() for buffer, _ in held)  # the writer maps these pages
        assert process.host_buffer_bytes() == thread.host_buffer_bytes()  # one snapshot, not a copy per process
    finally:
        thread.close()
        process.close()
    assert process._executor._writer is None


def test_each_executor_named_by_the_option_is_an_executor():
    """`executor_for` returns the `Executor` protocol for every value `unified_checkpoint_async_executor` takes (no
    process starts before the first save)."""
    for name in ASYNC_EXECUTORS:
        executor = executor_for(name)
        assert isinstance(executor, Executor), name
        executor.close()


def test_a_writer_that_dies_is_a_typed_error_at_the_next_wait_and_the_next_save_works(tmp_path):
    engine, saver = _engine(), AsyncSaver("process")
    try:
        final = str(tmp_path / "checkpoint-1")
        saver.start(engine, SaveRequest(final, 1, OPTIONS, show_progress=False), {})
        saver._executor._writer._process.kill()  # as the OOM killer would, while the save is in flight
        with pytest.raises(WriterProcessDied, match="rank 0 .* ended"):
            saver.wait()
        assert not os.path.exists(final) and os.listdir(tmp_path) == []  # nothing committed, nothing left
        assert not saver.in_flight
        again = _save(saver, engine, str(tmp_path / "checkpoint-2"), 2)
        assert detect_layout(again).complete
    finally:
        saver.close()


#: What the async save's driver (`async_save.AsyncSaver`) enters of the save layer, per call the trainer makes and on
#: the background thread, in order, each once (docs/architecture.md, "How a save and a resume flow"): the executor,
#: the algorithm's training-thread half, the background thread; then the snapshot, the executor running the other
#: half, the outcome; and at the wait, the background thread.
DRIVER = "hf_unified_ckpt.checkpoint.save.async_save"
DRIVER_ENTERS = {
    ("start", "training thread"): ["checkpoint.save.executors", "checkpoint.save.saving", "checkpoint.save.persist"],
    ("start", "background thread"): ["checkpoint.save.snapshot", "checkpoint.save.executors", "checkpoint.save.saving"],
    ("wait_for_snapshot", "training thread"): ["checkpoint.save.persist"],
    ("wait", "training thread"): ["checkpoint.save.persist"],
}


def test_one_async_save_enters_each_module_of_the_save_once_in_order(tmp_path):
    """sys.setprofile records every call the driver's frames make into another module of the package while one
    async save runs at world size 1: it composes nothing itself (the issue: it entered save.py five times)."""
    import sys
    import threading

    engine, saver = _engine(), AsyncSaver("thread")
    entered: dict[tuple[str, str], list[str]] = {}
    phase = ["start"]
    main = threading.main_thread()

    def profile(frame, event, arg):
        caller = frame.f_back
        if event != "call" or caller is None or caller.f_globals.get("__name__") != DRIVER:
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith("hf_unified_ckpt.") and module != DRIVER:
            thread = "training thread" if threading.current_thread() is main else "background thread"
            entered.setdefault((phase[0], thread), []).append(module.removeprefix("hf_unified_ckpt."))

    request = SaveRequest(str(tmp_path / "checkpoint-1"), 1, OPTIONS, show_progress=False)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        saver.start(engine, request, {"trainer_state.json": b"{}"})
        phase[0] = "wait_for_snapshot"
        saver.wait_for_snapshot()
        phase[0] = "wait"
        saver.wait()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        saver.close()
    background = entered.pop(("wait_for_snapshot", "background thread"), []) + entered.pop(
        ("wait", "background thread"), [])  # where the phase of the training thread stood when it ran
    entered[("start", "background thread")] = entered.get(("start", "background thread"), []) + background
    assert entered == DRIVER_ENTERS
    assert detect_layout(str(tmp_path / "checkpoint-1")).complete
