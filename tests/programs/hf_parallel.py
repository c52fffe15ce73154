"""transformers' own parallelism, unmodified: a tiny random Llama saved locally, loaded with
``from_pretrained(path, tp_plan="auto")`` (MODE tp) or ``distributed_config=
DistributedConfig(fsdp_size=N)`` (MODE fsdp: transformers' FSDP2), 3 AdamW steps; rank 0
prints each loss and a checksum of the last logits. Without a launcher (one process) it
loads the model plainly: the reference. Usage: hf_parallel.py DIR MODE (DIR: the model is
made and saved there if absent; run it alone first)"""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig

path, mode = sys.argv[1], sys.argv[2]
world = int(os.environ.get("WORLD_SIZE", "1"))
distributed = world > 1
if not os.path.exists(os.path.join(path, "config.json")):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(path)
if distributed and mode == "tp":
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
elif distributed:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(fsdp_size=world))
else:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ids = (torch.arange(16).reshape(2, 8) * 7) % 64
show = not distributed or torch.distributed.get_rank() == 0
for step in range(3):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if show:
        print(f"LOSS {step} {out.loss.item():.8f}", flush=True)
logits = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
if show:
    print(f"CHECKSUM {logits.double().abs().sum().item():.8f}", flush=True)
