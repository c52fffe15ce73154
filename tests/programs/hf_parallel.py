"""transformers' own parallelism, unmodified: a tiny random MODEL (llama, qwen2, qwen3_moe or diffllama)
saved locally, loaded with ``from_pretrained(path, tp_plan="auto")`` (MODE tp),
``distributed_config=DistributedConfig(fsdp_size=N)`` (MODE fsdp: transformers' FSDP2) or
``DistributedConfig(tp_size=2, fsdp_size=N // 2)`` (MODE tp_fsdp: both, on a 2-D mesh) or
``DistributedConfig(tp_size=2, fsdp_size=N // 2, ep_size=2)`` (MODE tp_fsdp_ep: the experts over
2 ranks besides, qwen3_moe) or ``DistributedConfig(pp_size=N)`` (MODE pp: transformers' pipeline
stages, inference only: one forward and its logits' checksum), 3 AdamW steps; rank 0 prints each loss and a checksum of the last logits.
MODE lora: peft's LoRA on the tp_plan="auto" model (its colwise q/v/up projections and the
embedding; peft wraps the adapters as DTensors), 3 AdamW steps on the adapters only, the
checksum of the adapters; with SAVE, the adapter is saved. MODE generate: greedy
``generate`` (8 new tokens, a left-padded row) with the DynamicCache and with
``cache_implementation="static"``: the token ids and the scores' checksum. With SAVE, the trained model
is then written with ``save_pretrained(SAVE)``. Without a launcher (one process) it loads the
model plainly: the reference. MODE reload (one process): loads each SAVE given (SAVE...), prints
how many keys were missing or unexpected and the loss of the reloaded model, each line marked
``@i`` with the SAVE's index. Usage: hf_parallel.py DIR MODEL MODE [SAVE...] (DIR/MODEL: made and
saved there if absent; run it alone first)"""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, DiffLlamaConfig, LlamaConfig, Qwen2Config, Qwen3MoeConfig
from transformers.distributed import DistributedConfig

folder, kind, mode = sys.argv[1:4]
save = sys.argv[4] if len(sys.argv) > 4 else None
world = int(os.environ.get("WORLD_SIZE", "1"))
distributed = world > 1
path = os.path.join(folder, kind)
ids = (torch.arange(16).reshape(2, 8) * 7) % 64
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=32)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "qwen2": lambda: Qwen2Config(**SMALL),
    # 4 experts of width 16, 2 chosen per token; the second layer dense (mlp_only_layers)
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                        num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True),
    # its lambda_* parameters are made on CPU while the loader leaves the rest on meta (FSDP)
    "diffllama": lambda: DiffLlamaConfig(**SMALL),
}

if mode == "reload":  # every SAVE given, in one process (importing transformers is the costly part)
    for index, where in enumerate(sys.argv[4:]):
        if os.path.exists(os.path.join(where, "adapter_config.json")):  # a LoRA adapter on the base model
            from peft import PeftModel
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), where)
            print(f"MISSING@{index} 0\nUNEXPECTED@{index} 0", flush=True)
            with torch.no_grad():
                print(f"RELOADED@{index} {model(input_ids=ids, labels=ids).loss.item():.8f}", flush=True)
            continue
        model, info = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, output_loading_info=True)
        print(f"MISSING@{index} {len(info['missing_keys'])} {sorted(info['missing_keys'])[:5]}", flush=True)
        print(f"UNEXPECTED@{index} {len(info['unexpected_keys'])} {sorted(info['unexpected_keys'])[:5]}", flush=True)
        with torch.no_grad():
            print(f"RELOADED@{index} {model(input_ids=ids, labels=ids).loss.item():.8f}", flush=True)
    sys.exit(0)

if not os.path.exists(os.path.join(path, "config.json")):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[kind]()).save_pretrained(path)
if distributed and mode in ("tp", "lora", "generate"):
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
elif distributed:
    sizes = {"tp_fsdp": dict(tp_size=2, fsdp_size=world // 2), "tp_fsdp_ep": dict(tp_size=2, fsdp_size=world // 2,
                                                                                    ep_size=2),
             "pp": dict(pp_size=world)}
    config = DistributedConfig(**sizes.get(mode, dict(fsdp_size=world)))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)
else:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
if mode == "pp":  # transformers' pipeline forward (no backward): every rank gets the last stage's logits
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not distributed or torch.distributed.get_rank() == 0:
        print(f"CHECKSUM {logits.double().abs().sum().item():.8f}", flush=True)
    sys.exit(0)
if mode == "generate":
    prompt, mask = ids[:, :5], torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    tokens, total = [], 0.0
    for cache in ({}, dict(cache_implementation="static")):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 return_dict_in_generate=True, output_scores=True, **cache)
        tokens += out.sequences.flatten().tolist()
        total += sum(s.double().abs().sum().item() for s in out.scores)  # every rank holds the whole logits
    if not distributed or torch.distributed.get_rank() == 0:
        print(f"TOKENS {','.join(map(str, tokens))}\nCHECKSUM {total:.8f}", flush=True)
    sys.exit(0)
if mode == "lora":
    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor import distribute_tensor

    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "embed_tokens"]))
    for name, param in model.named_parameters():  # the same values on any layout (peft draws by local shapes)
        if "lora_A" in name or "lora_embedding_B" in name:
            value = torch.randn(tuple(param.shape), generator=torch.Generator().manual_seed(sum(map(ord, name))))
            with torch.no_grad():
                if hasattr(param, "to_local"):
                    param.to_local().copy_(distribute_tensor(value * 0.1, param.device_mesh, param.placements).to_local())
                else:
                    param.copy_(value * 0.1)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
show = not distributed or torch.distributed.get_rank() == 0
for step in range(3):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if show:
        print(f"LOSS {step} {out.loss.item():.8f}", flush=True)
if mode == "lora":  # the adapters' checksum
    logits = torch.stack([(p.full_tensor() if hasattr(p, "full_tensor") else p).double().abs().sum()
                          for n, p in model.named_parameters() if "lora_" in n])
else:
    logits = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
if show:
    print(f"CHECKSUM {logits.double().abs().sum().item():.8f}", flush=True)
if save and mode == "lora":  # every rank gathers the adapters, rank 0 writes
    model.save_pretrained(save, is_main_process=not distributed or torch.distributed.get_rank() == 0)
elif save:
    model.save_pretrained(save)
