"""Three AdamW steps of torchtitan's own Llama 3 ("debugmodel" flavor), parallelized by
torchtitan's own ``ParallelDims`` and ``parallelize_llama`` (and, for the pipeline
configurations, its ``pipeline_llm``: its stage split, stages, ``get_mesh`` callback and
schedule), as its ``Trainer.train_step`` runs them (global valid tokens by
``dist_sum_tensor``, context-parallel input sharding, its loss, ``clip_grad_norm_`` over
the pipeline mesh too, the logged loss by ``dist_sum`` over the loss mesh).

The ``moe_*`` configurations train torchtitan's Qwen3 MoE, the ``dsv3_*`` ones its
DeepSeek-V3, with its expert parallelism (``expert_parallel_degree``, its
``AllToAllTokenDispatcher``, its MoE load-balancing optimizer hook, ``clip_grad_norm_(...,
ep_enabled=True)``); the ``full_*`` ones run under ``spmd_backend="full_dtensor"`` (inputs
wrapped by its ``full_dtensor.parallelize_inputs``), the others under "partial_dtensor".

A program written for torch.distributed: it imports nothing from mpidtensor. It runs
under ``torchrun`` (torch's DTensor on gloo), under ``mpiexec ... python -m
mpidtensor.run`` (mpidtensor), or alone with ``--reference`` (one process, no
parallelism: the losses the others must equal).

    torchtitan_step.py CONFIG OUT.json [--reference] [--layers N]

Only what torchtitan's API leaves to its caller is set here: the device (torchtitan
picks "cuda" when no accelerator is visible; its module-level ``device_type`` is
pointed at "cpu"), the inner attention (``ScaledDotProductAttention``: torchtitan's
language-model registry offers only flex attention, which it always compiles with
inductor), float32 parameters for FSDP's mixed precision (so that losses compare at
1e-5), the sharding config that ``Llama3Model.Config.update_from_config`` would set
(that method imports torchtitan's Trainer and so wandb and tensorboard), and the weights:
torchtitan's ``init_weights`` on a full model with one seed, each parameter's part then
copied into the sharded model by ``distribute_tensor`` (torchtitan's own ``init_weights``
runs there too, for the buffers).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.utils as tt_utils

# torchtitan chooses "cuda" when no accelerator is visible; it reads these module globals
for _module in (tt_utils, tt_parallel_dims, tt_dist_utils):
    _module.device_type = "cpu"
tt_utils.device_module = tt_dist_utils.device_module = torch.cpu

from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims, full_dtensor  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC  # noqa: E402
from torchtitan.distributed.context_parallel import prepare_context_parallel_input  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry as dsv3_registry  # noqa: E402
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config  # noqa: E402
from torchtitan.models.qwen3 import _build_qwen3_moe_layers  # noqa: E402
from torchtitan.models.qwen3 import model_registry as qwen3_registry  # noqa: E402
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config  # noqa: E402

# name: (dp_replicate, dp_shard, cp, tp, sequence parallel, activation checkpointing, compile)
CONFIGS = {
    "fsdp": (1, -1, 1, 1, True, False, False),
    "tp_sp": (1, 1, 1, -1, True, False, False),
    "tp": (1, 1, 1, -1, False, False, False),
    "fsdp_tp": (1, -1, 1, 2, True, False, False),
    "hsdp": (2, -1, 1, 1, True, False, False),
    "cp_fsdp": (1, -1, 2, 1, True, False, False),
    "fsdp_ac": (1, -1, 1, 1, True, True, False),
    "fsdp_compile": (1, -1, 1, 1, True, False, True),
    "pp_fsdp": (1, -1, 1, 1, True, False, False),
    "pp_tp": (1, 1, 1, 2, True, False, False),
    "pp_zbv_fsdp": (1, -1, 1, 1, True, False, False),
    "pp_csv_fsdp": (1, -1, 1, 1, True, False, False),
    # torchtitan's Qwen3 MoE ("debugmodel_moe", 2 blocks, 8 experts, top 2), experts
    # parallel by its AllToAllTokenDispatcher (degree in EXPERTS)
    "moe_fsdp": (1, -1, 1, 1, True, False, False),
    "moe_fsdp_ep2": (1, -1, 1, 1, True, False, False),
    "moe_fsdp_ep4": (1, -1, 1, 1, True, False, False),
    "moe_tp_ep2": (1, 1, 1, 2, True, False, False),
    "moe_fsdp_tp_ep2": (1, -1, 1, 2, True, False, False),
    "moe_fsdp_tp_ep4": (1, -1, 1, 2, True, False, False),
    "moe_tp_sp": (1, 1, 1, -1, True, False, False),
    "moe_hsdp_ep2": (2, -1, 1, 1, True, False, False),
    "moe_pp_fsdp_ep2": (1, -1, 1, 1, True, False, False),
    "moe_cp_fsdp_ep2": (1, -1, 2, 1, True, False, False),
    "moe_cp_fsdp_ep4": (1, -1, 2, 1, True, False, False),
    "moe_cp_tp_ep2": (1, 1, 2, 2, True, False, False),
}
# spmd_backend="full_dtensor": every parameter, buffer and input a DTensor on the whole dense
# mesh, FSDP over its data-parallel dims (DataParallelMeshDims); the rest "partial_dtensor"
FULL_DTENSOR = {"full_fsdp": (1, -1, 1, 1, True, False, False), "full_tp_sp": (1, 1, 1, -1, True, False, False),
                "full_fsdp_tp": (1, -1, 1, 2, True, False, False), "full_hsdp": (2, -1, 1, 1, True, False, False),
                "full_moe_fsdp_ep2": (1, -1, 1, 1, True, False, False),
                "full_moe_fsdp_tp_ep2": (1, -1, 1, 2, True, False, False),
                "full_cp_fsdp": (1, -1, 2, 1, True, False, False), "full_pp_fsdp": (1, -1, 1, 1, True, False, False),
                "full_pp_tp": (1, 1, 1, 2, True, False, False), "full_pp_zbv_fsdp": (1, -1, 1, 1, True, False, False)}
CONFIGS.update(FULL_DTENSOR)
# torchtitan's DeepSeek-V3 ("debugmodel": MLA attention, 8 routed + 2 shared experts, top 3;
# its first block dense, the second MoE)
DSV3 = {"dsv3_fsdp": (1, -1, 1, 1, True, False, False), "dsv3_fsdp_ep2": (1, -1, 1, 1, True, False, False),
        "dsv3_fsdp_tp_ep2": (1, -1, 1, 2, True, False, False)}
CONFIGS.update(DSV3)
EXPERTS = {"moe_cp_fsdp_ep2": 2, "moe_cp_fsdp_ep4": 4, "moe_cp_tp_ep2": 2, "dsv3_fsdp_ep2": 2, "dsv3_fsdp_tp_ep2": 2, "full_moe_fsdp_ep2": 2, "full_moe_fsdp_tp_ep2": 2, "moe_fsdp_ep2": 2, "moe_fsdp_ep4": 4, "moe_hsdp_ep2": 2, "moe_pp_fsdp_ep2": 2, "moe_tp_ep2": 2, "moe_fsdp_tp_ep2": 2, "moe_fsdp_tp_ep4": 4}
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN = 8, 2, 128
# pipeline configurations: name -> (pipeline degree, torchtitan's schedule name (with a
# file: how stages are placed), schedule file or None). The file is a zero-bubble order of
# 4 stages over 2 ranks and 2 micro-batches (one per FSDP rank's 2 sequences), written
# by hand in torch's CSV form, bubble cell included.
PIPELINES = {"pp_fsdp": (2, "1F1B", None), "full_pp_fsdp": (2, "1F1B", None),
             "full_pp_tp": (2, "Interleaved1F1B", None), "full_pp_zbv_fsdp": (2, "ZBVZeroBubble", None), "moe_pp_fsdp_ep2": (2, "1F1B", None), "pp_tp": (2, "Interleaved1F1B", None),
             "pp_zbv_fsdp": (2, "ZBVZeroBubble", None),
             "pp_csv_fsdp": (2, "ZBVZeroBubble", os.path.join(os.path.dirname(__file__), "zbv_pp2_mb2.csv"))}
STEPS, GLOBAL_BATCH, SEQ_LEN, SEED, LR = 3, 4, 32, 0, 8e-4


def model_config(layers: int, parallelism: ParallelismConfig):
    """torchtitan's debugmodel config with ``layers`` blocks and SDPA inner attention."""
    spec = model_registry("debugmodel")
    config = spec.model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    return spec, config


def moe_model_config(layers: int, parallelism: ParallelismConfig):
    """torchtitan's Qwen3 "debugmodel_moe" with ``layers`` blocks of MOE_EXPERTS experts
    (top MOE_TOP_K) and SDPA inner attention, sharded as its ``update_from_config`` would."""
    spec = qwen3_registry("debugmodel_moe")
    config = spec.model
    config.layers = _build_qwen3_moe_layers(
        n_layers=layers, dim=config.dim, n_heads=16, n_kv_heads=8, head_dim=128, moe_hidden_dim=MOE_HIDDEN,
        num_experts=MOE_EXPERTS, top_k=MOE_TOP_K, attn_backend="flex", moe_comm_backend="standard",
        rope=dataclasses.replace(config.layers[0].attention.rope, max_seq_len=SEQ_LEN))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel,
                              enable_ep=parallelism.expert_parallel_degree > 1)
    return spec, config


def dsv3_model_config(layers: int, parallelism: ParallelismConfig):
    """torchtitan's DeepSeek-V3 "debugmodel" with its first ``layers`` blocks and SDPA inner
    attention, sharded as its ``update_from_config`` would."""
    spec = dsv3_registry("debugmodel")
    config = spec.model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_deepseek_v3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel,
                                    enable_ep=parallelism.expert_parallel_degree > 1)
    return spec, config


class _OneProcessDims:
    """What torchtitan's MoE load-balancing hook reads of ``ParallelDims`` in one process."""
    ep_enabled, tp = False, 1

    def get_optional_mesh(self, name):
        return None


def full_weights(config) -> dict[str, torch.Tensor]:
    """torchtitan's own init of the whole model, seeded: the same on every rank."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {name: tensor.detach().clone() for name, tensor in model.named_parameters()}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Each parameter (a DTensor of any layout) gets its part of the full weight."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    wrappers = ("_checkpoint_wrapped_module.", "_orig_mod.")
    with torch.no_grad():
        for name, param in model.named_parameters():
            for wrapper in wrappers:
                name = name.replace(wrapper, "")
            full = weights[name]
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements)
            param.copy_(full)


def _value(loss: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as a plain scalar: a DTensor's local value, as torchtitan's
    ``dist_sum`` takes it (under ``full_dtensor`` the loss is ``Partial`` over the batch
    mesh, which the logged loss's ``dist_sum`` over the loss mesh then adds up)."""
    return loss.detach().to_local() if hasattr(loss, "to_local") else loss.detach()


def batches() -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, 2048, (STEPS, GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("out")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sum-reduction", action="store_true",
                        help="FSDP reduces with SUM then divides (torch's gloo refuses PREMUL_SUM)")
    args = parser.parse_args()
    dp_replicate, dp_shard, cp, tp, sp, ac, compiled = CONFIGS[args.config]
    pp, schedule, schedule_csv = PIPELINES.get(args.config, (1, "1F1B", None))
    ep, moe = EXPERTS.get(args.config, 1), "moe" in args.config
    reference = args.reference
    if reference:
        dp_replicate = dp_shard = cp = tp = pp = ep = 1
    else:
        dist.init_process_group(backend="gloo")
    world_size = dist.get_world_size() if not reference else 1
    if tp == -1:
        tp = world_size
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=dp_replicate, data_parallel_shard_degree=dp_shard,
        context_parallel_degree=cp, tensor_parallel_degree=tp, enable_sequence_parallel=sp,
        spmd_backend="full_dtensor" if args.config in FULL_DTENSOR else "partial_dtensor",
        context_parallel_load_balancer="headtail",
        pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=1,
        pipeline_parallel_schedule_csv=schedule_csv or "", expert_parallel_degree=ep,
    )
    batch_degree = 1 if reference else world_size // (pp * cp * tp)  # dp_replicate x dp_shard
    training = TrainingConfig(local_batch_size=GLOBAL_BATCH // batch_degree, seq_len=SEQ_LEN, steps=STEPS,
                              mixed_precision_param="float32", max_norm=1.0)
    compile_config = CompileConfig(enable=compiled, components=["model"], backend="aot_eager")
    tt_dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as Trainer.__init__ does
    build = dsv3_model_config if args.config.startswith("dsv3") else moe_model_config if moe else model_config
    spec, config = build(args.layers, parallelism)
    weights = full_weights(config)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=config.vocab_size))
    device = torch.device("cpu")

    with torch.device("meta"):
        model = config.build()
    parallel_dims = pp_schedule = None
    if reference:
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)  # the buffers (RoPE) too
        load_weights(model, weights)
    else:
        parallel_dims = ParallelDims.from_config(parallelism, world_size)
        parallel_dims.build_mesh()
        parallelize = dict(parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                           compile_config=compile_config, ac_config=FullAC.Config() if ac else None, dump_folder="")
        if pp > 1:  # Trainer.__init__'s pipelining_fn
            pp_schedule, parts, has_first, has_last = pipeline_llm(
                model, device=device, model_config=config, parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn,
                **parallelize)
        else:
            parts = [spec.parallelize_fn(model, **parallelize)]
        for part in parts:
            part.to_empty(device=device)
            with torch.no_grad():
                part.init_weights(buffer_device=None)
            load_weights(part, weights)
        if args.sum_reduction:
            from torch.distributed.fsdp import FSDPModule
            for module in (m for part in parts for m in part.modules()):
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        model = parts[-1]
    parts = [model] if reference else parts
    for part in parts:
        part.train()
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    if spec.post_optimizer_build_fn is not None:  # MoE: the expert-bias update before each step
        spec.post_optimizer_build_fn(optimizer, parts, parallel_dims or _OneProcessDims())

    if parallel_dims is not None and parallel_dims.dp_enabled:
        batch_mesh = parallel_dims.get_mesh("batch")
        batch_degree, batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    else:
        batch_degree, batch_rank = 1, 0
    local = GLOBAL_BATCH // batch_degree
    losses, norms, exact_norms, start = [], [], [], time.monotonic()
    for tokens in batches():
        tokens = tokens[batch_rank * local:(batch_rank + 1) * local]
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        optimizer.zero_grad()
        # Trainer.train_step: the global valid-token count, then forward_backward_step
        local_valid_tokens = (labels != IGNORE_INDEX).sum()
        if parallel_dims is not None and parallel_dims.dp_enabled:
            global_valid_tokens = tt_dist_utils.dist_sum_tensor(local_valid_tokens, batch_mesh)
        else:
            global_valid_tokens = local_valid_tokens
        extra_kwargs = {}
        if parallel_dims is not None and parallel_dims.cp_enabled:
            extra_kwargs["positions"] = torch.arange(SEQ_LEN).expand(local, SEQ_LEN).contiguous()
            inputs, labels, extra_kwargs = prepare_context_parallel_input(
                inputs, labels, extra_kwargs, parallel_dims.get_mesh("cp"), device,
                parallelism.context_parallel_load_balancer,
            )
        if parallel_dims is not None and parallelism.spmd_backend == "full_dtensor":  # Trainer.post_dataloading_process
            inputs, labels, extra_kwargs = full_dtensor.parallelize_inputs(parallel_dims, inputs, labels, extra_kwargs)
        if pp_schedule is not None:  # Trainer.pp_forward_backward_step, on the whole batch
            step_losses = [] if has_last else None
            pp_schedule.step(*((inputs,) if has_first else ()), target=labels if has_last else None,
                             losses=step_losses, loss_kwargs={"global_valid_tokens": global_valid_tokens},
                             return_outputs=False)
            loss = torch.stack([_value(x) for x in step_losses]).sum() if has_last else torch.zeros(())
            dist.all_reduce(loss, group=parallel_dims.get_mesh("pp").get_group())  # to the first stage's ranks
        else:
            pred = model(inputs, **extra_kwargs)
            loss, _ = loss_fn(pred, labels, global_valid_tokens)
            del pred
            loss.backward()
        if reference:  # plain torch's float32 norm of a large gradient is off by up to ~1e-4
            exact_norms.append(float(torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().sqrt()))
        grad_norm = tt_dist_utils.clip_grad_norm_(
            params, training.max_norm, foreach=True,
            pp_mesh=None if parallel_dims is None else parallel_dims.get_optional_mesh("pp"),
            ep_enabled=parallel_dims is not None and parallel_dims.ep_enabled,
        )
        optimizer.step()
        loss = loss.detach()
        if parallel_dims is not None and parallel_dims.dp_cp_enabled:
            losses.append(tt_dist_utils.dist_sum(loss, parallel_dims.get_optional_mesh("loss")))
        else:
            losses.append(float(loss.item() if not hasattr(loss, "full_tensor") else loss.full_tensor().item()))
        norms.append(float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm))
    rank = 0 if reference else dist.get_rank()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "world_size": world_size, "losses": losses, "grad_norms": norms,
                       "grad_norms_float64": exact_norms,
                       "seconds": time.monotonic() - start,
                       "dtensor": type(params[-1]).__module__,
                       "mesh": list(getattr(getattr(params[0], "device_mesh", None), "mesh_dim_names", None) or [])}, f)
    if not reference:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
