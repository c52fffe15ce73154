"""accelerate's FSDP2 and transformers' Trainer, unmodified: the tiny random Llama saved in
DIR/llama (hf_parallel.py makes it), 3 AdamW steps on the same batch on every rank; rank 0
prints each loss (averaged over ranks), a checksum of the last logits, and after a
``save_state``/``load_state`` round trip the loss of the reloaded model.
MODE plugin: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``;
MODE pc: the same with ``ParallelismConfig(dp_shard_size=N)``;
MODE trainer: ``Trainer(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` (prints its logged
losses and the final loss on the batch).
Without a launcher (one process) every mode trains the plain model: the reference.
accelerate keeps a CPU job as DDP (``DistributedType.MULTI_CPU``) whatever FSDP plugin it is
given, for torch's own run as well; :func:`fsdp_on_cpu` undoes that, alike under the switch
and on torch. Usage: hf_accelerate.py DIR MODE WORK (WORK: a folder for the saved state)"""
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

folder, mode, work = sys.argv[1:4]
path = os.path.join(folder, "llama")
world = int(os.environ.get("WORLD_SIZE", "1"))
distributed = world > 1
ids = (torch.arange(32).reshape(4, 8) * 7) % 64


def fsdp_on_cpu() -> None:
    """Make accelerate use the FSDP plugin it is given on CPU (it keeps MULTI_CPU: DDP)."""
    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


def require_sharded(model: torch.nn.Module) -> None:
    """Stop (every rank alike) unless FSDP2 sharded the model: the run would prove nothing."""
    if distributed and not all(hasattr(param, "full_tensor") for param in model.parameters()):
        raise SystemExit("the model's parameters are not DTensors: FSDP2 did not shard it")


def show(line: str) -> None:
    if not distributed or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def trainer() -> None:
    rows = [{"input_ids": row, "labels": row} for row in ids]
    fsdp = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2}) if distributed else {}
    args = TrainingArguments(output_dir=work, max_steps=3, per_device_train_batch_size=len(rows) // world,
                             learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.01, warmup_steps=0,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             dataloader_drop_last=True, **fsdp)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    run = Trainer(model=model, args=args, train_dataset=rows)
    run.train()
    require_sharded(run.model)
    for step, entry in enumerate(e for e in run.state.log_history if "loss" in e):
        show(f"LOSS {step} {entry['loss']:.8f}")
    with torch.no_grad():
        loss = run.model(input_ids=ids, labels=ids).loss
    show(f"CHECKSUM {loss.item():.8f}")


def accelerated() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if distributed else None
    config = ParallelismConfig(dp_shard_size=world) if distributed and mode == "pc" else None
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, parallelism_config=config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    require_sharded(model)
    for step in range(3):
        out = model(input_ids=ids, labels=ids)
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        show(f"LOSS {step} {accelerator.reduce(out.loss.detach(), 'mean').item():.8f}")
    logits = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
    show(f"CHECKSUM {logits.double().abs().sum().item():.8f}")
    accelerator.save_state(work)
    accelerator.wait_for_everyone()
    with torch.no_grad():  # spoil the weights: load_state must bring them back
        for param in model.parameters():
            param.mul_(0.5)
    accelerator.load_state(work)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    show(f"RELOADED {accelerator.reduce(loss, 'mean').item():.8f}")


fsdp_on_cpu()
trainer() if mode == "trainer" else accelerated()
