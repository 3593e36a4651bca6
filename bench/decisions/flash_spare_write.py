"""Flash memory reuse (issue 32): a unified save into /dev/shm written over the spare files an evicted memory
checkpoint left (`SaveRequest.spare`, what the memory tier does from its (K+1)-th save on) vs into fresh memory.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 bench/decisions/flash_spare_write.py

DDP x 2 (gloo) on bench_save.py's 103M Llama after one step; six saves of the 1.23 GB checkpoint into
/dev/shm/flash-spare-bench, alternating fresh (nothing to reuse) and spare (the previous checkpoint's tensor files
moved to the spare folder), 3 s apart; prints each save's time on every rank (the save returns when every rank is
done, so the times agree). On this VM, memory that was free for a while is handed back to the host and writing
into it costs several times a copy; memory just freed does not.
"""
import sys, time, os, shutil, glob
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # bench/: bench_save
from bench_save import bench_model, SIZES
import torch
from transformers import Trainer
import hf_unified_ckpt
from hf_unified_ckpt.checkpoint.save.saving import SaveRequest, save_checkpoint
torch.set_num_threads(1)
model, params, data = bench_model(SIZES["103m"])
out = "/dev/shm/flash-spare-bench"
args = hf_unified_ckpt.UnifiedCheckpointArguments(output_dir=out, max_steps=1, per_device_train_batch_size=2, save_strategy="no", ddp_backend="gloo",
    use_cpu=True, report_to=[], disable_tqdm=True, unified_checkpoint=True, logging_steps=1000)
t = Trainer(model=model, args=args, train_dataset=data); hf_unified_ckpt.attach(t); t.train()
import torch.distributed as dist
engine = t._uc_session.engine(); opts = t.args.unified_checkpoint_options
spare = out + "/spare"
for i in range(6):
    use = i % 2 == 1 and i > 0
    dist.barrier(); s = time.perf_counter()
    save_checkpoint(engine, SaveRequest(f"{out}/checkpoint-{i}", i, opts, show_progress=False, spare=spare if use else None), {})
    dt = time.perf_counter() - s
    print(dist.get_rank(), i, "spare" if use else "fresh", round(dt, 2), flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(spare, ignore_errors=True); os.makedirs(spare)
        for f in glob.glob(f"{out}/checkpoint-{i}/*.safetensors"): os.rename(f, spare + "/" + os.path.basename(f))
        shutil.rmtree(f"{out}/checkpoint-{i}")
    dist.barrier()
    if i % 2 == 1 and dist.get_rank() == 0: shutil.rmtree(spare); os.makedirs(spare)  # fresh next time
    time.sleep(3)
dist.barrier()
if dist.get_rank() == 0: shutil.rmtree(out)
