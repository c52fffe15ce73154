"""The model zoo: tiny Hugging Face transformers models (random init from configs, nothing
downloaded) with their batches, FSDP blocks and tensor-parallel plans, shared by the
tests/test_zoo_*.py files.

Every config divides its heads (12), hidden sizes and MLP widths by 2, 3 and 4; dropout is
off, so one process and a parallel run compute the same function. Attention is "eager"
unless a test asks for another implementation.
A model's TP plan is its own ``model.tp_plan`` (built by transformers from
``config.base_model_tp_plan``) translated to mpidtensor's styles where it has one, else
one written here in the same spirit (Megatron: q/k/v and the MLP's first projections
column-wise, the output projections row-wise, each rank computing on its own heads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import transformers
from mpi4py import MPI
from torch import nn

from helpers import assert_all_ranks, assert_close
from mpidtensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from mpidtensor.fsdp import fully_shard
from mpidtensor.mesh import DeviceMesh
from mpidtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    from_hf_plan,
    parallelize_module,
)

VOCAB, SEQ, BATCH, HEADS = 128, 8, 12, 12  # BATCH divides by 1-4: each data-parallel rank gets an equal shard
STEPS, LR = 3, 1e-2
# AdamW moves a weight by about LR * m / (sqrt(v) + eps): for a gradient entry near zero the
# rounding of sharded sums shifts that ratio, so parameters agree to a fraction of LR. With
# torch's eps of 1e-8, an entry of -1.7e-8 in one process (Qwen3's embedding has one) that
# rounds to -5e-10 in a parallel run moves the weight by 0.62 LR there and by 0.05 LR here;
# an eps of 1e-6 keeps such differences below PARAM_ATOL. The first gradients, compared
# directly, pin the scale AdamW's update would hide.
ADAM_EPS = 1e-6
PARAM_ATOL, GRAD_ATOL = 1e-3, 1e-6

# --- the zoo ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Zoo:
    """One model: how to build it, a batch, its FSDP blocks and its TP plans."""

    name: str
    config: Callable[[], transformers.PretrainedConfig]
    model_class: Callable[[], type]
    make_batch: Callable[[torch.Generator], tuple[dict, torch.Tensor]]
    blocks: Callable[[nn.Module], list[nn.Module]]
    tensor_parallel: Callable[[nn.Module, DeviceMesh], None]
    #: TP + SequenceParallel, or the reason the architecture has none
    sequence_parallel: Callable[[nn.Module, DeviceMesh], None] | str

    def build(self, seed: int = 0, attention: str = "eager") -> nn.Module:
        """The model with random weights from ``seed``; ``attention``: transformers'
        attention implementation ("eager", "sdpa")."""
        config = self.config()
        config._attn_implementation = attention
        torch.manual_seed(seed)
        return self.model_class()(config).train()

    def batches(self, steps: int = STEPS, seed: int = 7) -> list[tuple[dict, torch.Tensor]]:
        """``steps`` global batches (inputs, targets), the same on every rank."""
        gen = torch.Generator().manual_seed(seed)
        return [self.make_batch(gen) for _ in range(steps)]


def loss_of(model: nn.Module, inputs: dict, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the model's logits (token-level or per sequence) against ``target``."""
    logits = model(**inputs).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def shard(batch: tuple[dict, torch.Tensor], index: int, count: int) -> tuple[dict, torch.Tensor]:
    """Rows ``[index * B / count, (index + 1) * B / count)`` of every batch tensor."""
    inputs, target = batch
    rows = target.shape[0] // count
    pick = slice(index * rows, (index + 1) * rows)
    return {k: v[pick] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, target[pick]


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient, whole (``full_tensor``: a collective over its mesh);
    frozen ones (a LoRA model's base weights) have none."""
    grads = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return grads


def train(model: nn.Module, batches: list, dp_rank: int = 0, dp_size: int = 1,
          dp_comm: MPI.Comm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AdamW steps, one per batch, on this rank's data-parallel shard of each: the losses
    (averaged over ``dp_comm``; data-parallel ranks see equal shards) and the first
    step's gradients (whole: AdamW's update hides a gradient's scale)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, grads = [], None
    for batch in batches:
        loss = loss_of(model, *shard(batch, dp_rank, dp_size))
        loss.backward()
        grads = grads or _gradients(model)
        opt.step()
        opt.zero_grad()
        value = loss.detach().item()
        losses.append(dp_comm.allreduce(value) / dp_size if dp_comm is not None else value)
    return torch.tensor(losses), grads


def train_reference(model: nn.Module, batches: list,
                    dp_size: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process doing what ``dp_size`` data-parallel ranks do together: each step's loss is
    the mean of the losses of the ``dp_size`` shards, each computed alone (so BatchNorm sees
    the statistics of one shard, as it does on each rank)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, grads = [], None
    for batch in batches:
        loss = sum(loss_of(model, *shard(batch, r, dp_size)) for r in range(dp_size)) / dp_size
        loss.backward()
        grads = grads or _gradients(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
    return torch.tensor(losses), grads


def check_trains_like_one_process(model: nn.Module, ref: nn.Module, batches: list, dp_rank: int = 0,
                                  dp_size: int = 1, dp_comm: MPI.Comm | None = None) -> None:
    """``model`` (parallelized) and ``ref`` (its one-process copy) train alike: losses,
    first gradients and final parameters (collective verdicts)."""
    ref_losses, ref_grads = train_reference(ref, batches, dp_size)
    losses, grads = train(model, batches, dp_rank, dp_size, dp_comm)
    assert_close(losses, ref_losses, atol=1e-5, rtol=1e-5)
    bad = {name: (grad - ref_grads[name]).abs().max().item() for name, grad in grads.items()
           if not torch.allclose(grad, ref_grads[name], atol=GRAD_ATOL, rtol=1e-4)}
    assert_all_ranks(not bad, f"first gradients differ from one process (max abs diff): {bad}")
    differ = parameter_differences(model, ref, PARAM_ATOL)
    assert_all_ranks(not differ, f"parameters differ from one process (max abs diff): {differ}")


def parameter_differences(model: nn.Module, ref: nn.Module, atol: float) -> dict[str, float]:
    """Parameters (gathered with ``full_tensor``) that differ from the reference's by more
    than ``atol`` (max abs difference by name); a collective over the model's meshes."""
    ref_params = dict(ref.named_parameters())
    differ = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        error = (full.detach() - ref_params[name].detach()).abs().max().item()
        if not error <= atol:
            differ[name] = error
    return differ


def fully_shard_zoo(model: nn.Module, zoo: "Zoo", mesh: DeviceMesh) -> nn.Module:
    """FSDP2 as frameworks apply it: ``fully_shard`` on every block, then on the root."""
    for block in zoo.blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# --- batches ------------------------------------------------------------------------------------


def _tokens(gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return {"input_ids": ids[:, :-1], "use_cache": False}, ids[:, 1:]


def _padding_mask(gen: torch.Generator) -> torch.Tensor:
    """1 for tokens, 0 for right padding: each row keeps 3 to SEQ tokens."""
    lengths = torch.randint(3, SEQ + 1, (BATCH, 1), generator=gen)
    return (torch.arange(SEQ) < lengths).long()


def _bert_batch(gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    token_types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ)
    mask = _padding_mask(gen)
    inputs = {"input_ids": ids * mask, "token_type_ids": token_types, "attention_mask": mask}
    return inputs, torch.randint(0, 3, (BATCH,), generator=gen)


def _t5_batch(gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    mask = _padding_mask(gen)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    decoder_ids = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    inputs = {"input_ids": ids * mask, "attention_mask": mask, "decoder_input_ids": decoder_ids, "use_cache": False}
    return inputs, labels


def _image_batch(gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    pixels = torch.randn(BATCH, 3, 16, 16, generator=gen)
    return {"pixel_values": pixels}, torch.randint(0, 3, (BATCH,), generator=gen)


# --- tensor-parallel plans ----------------------------------------------------------------------


def _decoder_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Llama / Qwen2: the model's own plan (``model.tp_plan``: base_model_tp_plan, the
    vocabulary-sharded embedding and the gathered lm_head)."""
    parallelize_module(model, mesh, from_hf_plan(model.tp_plan))


def _decoder_sp(model: nn.Module, mesh: DeviceMesh, extra: dict[str, ParallelStyle] | None = None) -> None:
    """Llama / Qwen2 with sequence parallelism (torchtitan's plan): the residual stream is a
    DTensor sharded on the sequence; norms run on sequence shards; each attention / MLP
    gathers its input once and reduce-scatters its output. ``extra``: more of the plan."""
    seq = Shard(1)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate()),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan | (extra or {}))


def _qwen3_sp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Qwen3: the decoder plan, with the per-head q_norm / k_norm on this rank's heads (their
    weight gradients summed over the mesh, as its own plan's ``replicated_with_grad_allreduce``)."""
    norms = "model.layers.*.self_attn.[qk]_norm"
    _decoder_sp(model, mesh, from_hf_plan({norms: "replicated_with_grad_allreduce"}))


def _conv1d_parallel(module: nn.Module, mesh: DeviceMesh, colwise: list[str], rowwise: list[str],
                     sequence_parallel: bool) -> None:
    """GPT-2's Conv1D (a Linear with the weight transposed, which torch's TP styles do not
    take) made tensor-parallel with ``distribute_module``: the column-wise Conv1Ds' weights
    ``Shard(1)`` and biases ``Shard(0)``, the row-wise ones' weights ``Shard(0)``; the module
    computes on DTensors from a replicated (or, with ``sequence_parallel``,
    sequence-sharded) input, and its output is all-reduced (reduce-scattered to sequence
    shards, kept a DTensor)."""
    layouts = {f"{n}.weight": Shard(1) for n in colwise} | {f"{n}.bias": Shard(0) for n in colwise}
    layouts |= {f"{n}.weight": Shard(0) for n in rowwise}
    given = Shard(1) if sequence_parallel else Replicate()

    def partition(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(sub.named_parameters(recurse=False)):
            layout = layouts.get(f"{name}.{pname}", Replicate())
            sub.register_parameter(pname, nn.Parameter(distribute_tensor(param.data, mesh, [layout])))

    def inputs(_, args: tuple, mesh: DeviceMesh) -> tuple:
        x = args[0] if isinstance(args[0], DTensor) else DTensor.from_local(args[0], mesh, [given], run_check=False)
        return (x.redistribute(mesh, [Replicate()]), *args[1:])

    def outputs(_, out, mesh: DeviceMesh):
        first = out[0] if isinstance(out, tuple) else out
        first = first.redistribute(mesh, [given])
        first = first if sequence_parallel else first.to_local()
        return (first, *out[1:]) if isinstance(out, tuple) else first

    distribute_module(module, mesh, partition, inputs, outputs)


def _gpt2_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """GPT-2 has no TP plan; this one shards each block's attention (c_attn column-wise,
    c_proj row-wise) and MLP (c_fc column-wise, c_proj row-wise). The tied embedding and
    lm_head stay replicated. c_attn is a fused q/k/v projection: its column shards do not
    fall on head boundaries of q, k and v, so the attention runs on DTensors (the split
    into q, k, v redistributes) rather than on local heads."""
    for block in model.transformer.h:
        _conv1d_parallel(block.attn, mesh, ["c_attn"], ["c_proj"], sequence_parallel)
        _conv1d_parallel(block.mlp, mesh, ["c_fc"], ["c_proj"], sequence_parallel)


def _gpt2_sp(model: nn.Module, mesh: DeviceMesh) -> None:
    """GPT-2 with SP: the embeddings' sum is sequence-sharded at the dropout, ln_1 / ln_2 /
    ln_f run on sequence shards, and ln_f's output is gathered for the replicated lm_head."""
    seq = Shard(1)
    parallelize_module(model, mesh, {
        "transformer.drop": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=seq),
        "transformer.h.*.ln_[12]": SequenceParallel(),
        "transformer.ln_f": SequenceParallel(),
    })
    parallelize_module(model, mesh, {"lm_head": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(),
                                                                    use_local_output=True)})
    _gpt2_tp(model, mesh, sequence_parallel=True)


def _bert_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """BERT has no TP plan: Megatron's on each layer (the attention computes on local heads:
    BERT views its projections as ``(..., -1, head_size)``)."""
    parallelize_module(model, mesh, {
        "bert.encoder.layer.*.attention.self.query": ColwiseParallel(),
        "bert.encoder.layer.*.attention.self.key": ColwiseParallel(),
        "bert.encoder.layer.*.attention.self.value": ColwiseParallel(),
        "bert.encoder.layer.*.attention.output.dense": RowwiseParallel(),
        "bert.encoder.layer.*.intermediate.dense": ColwiseParallel(),
        "bert.encoder.layer.*.output.dense": RowwiseParallel(),
    })


def _bert_sp(model: nn.Module, mesh: DeviceMesh) -> None:
    """BERT (post-norm) with SP: the embeddings' output is sequence-sharded, every
    LayerNorm after a residual add runs on sequence shards, the pooler gets it gathered."""
    seq = Shard(1)
    parallelize_module(model, mesh, {
        "bert.embeddings": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq,
                                               use_local_output=False),
        "bert.encoder.layer.*.attention.self": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "bert.encoder.layer.*.attention.self.query": ColwiseParallel(),
        "bert.encoder.layer.*.attention.self.key": ColwiseParallel(),
        "bert.encoder.layer.*.attention.self.value": ColwiseParallel(),
        "bert.encoder.layer.*.attention.output.dense": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "bert.encoder.layer.*.attention.output.LayerNorm": SequenceParallel(),
        "bert.encoder.layer.*.intermediate.dense": ColwiseParallel(input_layouts=seq),
        "bert.encoder.layer.*.output.dense": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "bert.encoder.layer.*.output.LayerNorm": SequenceParallel(),
        "bert.pooler": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(), use_local_output=True),
    })


def _t5_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """T5 has no TP plan: q/k/v column-wise, o row-wise (self- and cross-attention), the
    relative position bias embedding sharded on its head dim (each rank's bias for its own
    heads), the gated feed-forward's wi_0 / wi_1 column-wise and wo row-wise. T5 sizes the zero position
    bias of its cross-attention by ``n_heads``: set to the local head count.

    With ``sequence_parallel``: both stacks' embeddings are sequence-sharded, every
    T5LayerNorm runs on sequence shards, attention (its query input and the encoder
    states of cross-attention) and the feed-forward gather their inputs, the output
    projections reduce-scatter, and lm_head gets the decoder's output gathered."""
    seq = Shard(1)
    out = seq if sequence_parallel else Replicate()
    plan = {
        "*.block.*.layer.*.*.[qkv]": ColwiseParallel(),
        "*.block.*.layer.*.*.o": RowwiseParallel(output_layouts=out, use_local_output=not sequence_parallel),
        "*.block.0.layer.0.SelfAttention.relative_attention_bias": ColwiseParallel(),
        "*.block.*.layer.*.DenseReluDense.wi_[01]": ColwiseParallel(),
        "*.block.*.layer.*.DenseReluDense.wo": RowwiseParallel(output_layouts=out,
                                                               use_local_output=not sequence_parallel),
    }
    if sequence_parallel:
        plan |= {
            "*.embed_tokens": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq,
                                                  use_local_output=False),
            "*.block.*.layer.*.layer_norm": SequenceParallel(),
            "*.final_layer_norm": SequenceParallel(),
            "*.block.*.layer.*.*Attention": PrepareModuleInput(
                input_layouts=seq, desired_input_layouts=Replicate(),
                input_kwarg_layouts={"key_value_states": seq},
                desired_input_kwarg_layouts={"key_value_states": Replicate()}),
            "*.block.*.layer.*.DenseReluDense": PrepareModuleInput(input_layouts=seq,
                                                                   desired_input_layouts=Replicate()),
            "lm_head": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(), use_local_output=True),
        }
    parallelize_module(model, mesh, plan)
    for module in model.modules():
        if isinstance(module, transformers.models.t5.modeling_t5.T5Attention):
            module.n_heads //= mesh.size()


def _t5_sp(model: nn.Module, mesh: DeviceMesh) -> None:
    _t5_tp(model, mesh, sequence_parallel=True)


def _vit_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """ViT has no TP plan: Megatron's on each layer (local heads, as BERT)."""
    parallelize_module(model, mesh, _vit_layer_plan(Replicate(), Replicate()))


def _vit_layer_plan(given, output) -> dict[str, ParallelStyle]:
    local = isinstance(output, Replicate)
    return {
        "vit.layers.*.attention.[qkv]_proj": ColwiseParallel(input_layouts=given),
        "vit.layers.*.attention.o_proj": RowwiseParallel(output_layouts=output, use_local_output=local),
        "vit.layers.*.mlp.fc1": ColwiseParallel(input_layouts=given),
        "vit.layers.*.mlp.fc2": RowwiseParallel(output_layouts=output, use_local_output=local),
    }


def _vit_sp(model: nn.Module, mesh: DeviceMesh) -> None:
    """ViT (pre-norm) with SP: the patch embeddings (17 positions with the CLS token: uneven
    shards) are sequence-sharded, layernorm_before / layernorm_after run on shards, the
    final layernorm gets the sequence gathered."""
    seq = Shard(1)
    plan = {
        "vit.embeddings": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq,
                                              use_local_output=False),
        "vit.layers.*.layernorm_*": SequenceParallel(),
        "vit.layernorm": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(),
                                            use_local_output=True),
    }
    parallelize_module(model, mesh, plan | _vit_layer_plan(seq, seq))


def _resnet_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """ResNet has no TP plan and its body is convolutions, which torch's TP styles do not
    shard: the classifier's Linear column-wise, gathered; the convolutions replicated."""
    parallelize_module(model, mesh, {"classifier.1": ColwiseParallel(output_layouts=Replicate())})


def _decoder_config(config_class: str, **extra) -> Callable[[], transformers.PretrainedConfig]:
    """Grouped-query attention (24 query heads over 12 KV heads of 4 dims) and RoPE."""
    return lambda: getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2 * HEADS,
        num_key_value_heads=HEADS, head_dim=4, max_position_embeddings=4 * SEQ, tie_word_embeddings=False, **extra)


ZOO: dict[str, Zoo] = {
    zoo.name: zoo
    for zoo in (
        Zoo("llama", _decoder_config("LlamaConfig"), lambda: transformers.LlamaForCausalLM, _tokens,
            lambda m: list(m.model.layers), _decoder_tp, _decoder_sp),
        # a pad token: the vocabulary-parallel embedding has a padding_idx (row 0, on rank 0)
        Zoo("qwen2", _decoder_config("Qwen2Config", pad_token_id=0), lambda: transformers.Qwen2ForCausalLM, _tokens,
            lambda m: list(m.model.layers), _decoder_tp, _decoder_sp),
        # per-head q_norm / k_norm between the column and row Linears (its plan's
        # replicated_with_grad_allreduce)
        Zoo("qwen3", _decoder_config("Qwen3Config"), lambda: transformers.Qwen3ForCausalLM, _tokens,
            lambda m: list(m.model.layers), _decoder_tp, _qwen3_sp),
        Zoo("gpt2", lambda: transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=4 * SEQ, n_embd=48, n_layer=2, n_head=HEADS, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1),
            lambda: transformers.GPT2LMHeadModel, _tokens, lambda m: list(m.transformer.h), _gpt2_tp, _gpt2_sp),
        Zoo("bert", lambda: transformers.BertConfig(
                vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=96,
                max_position_embeddings=4 * SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                num_labels=3),
            lambda: transformers.BertForSequenceClassification, _bert_batch,
            lambda m: list(m.bert.encoder.layer), _bert_tp, _bert_sp),
        Zoo("t5", lambda: transformers.T5Config(
                vocab_size=VOCAB, d_model=48, d_kv=4, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=HEADS,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                decoder_start_token_id=0, pad_token_id=0, feed_forward_proj="gated-gelu"),
            lambda: transformers.T5ForConditionalGeneration, _t5_batch,
            lambda m: [*m.encoder.block, *m.decoder.block], _t5_tp, _t5_sp),
        Zoo("vit", lambda: transformers.ViTConfig(
                image_size=16, patch_size=4, num_channels=3, hidden_size=48, num_hidden_layers=2,
                num_attention_heads=HEADS, intermediate_size=96, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, num_labels=3),
            lambda: transformers.ViTForImageClassification, _image_batch,
            lambda m: list(m.vit.layers), _vit_tp, _vit_sp),
        Zoo("resnet", lambda: transformers.ResNetConfig(
                num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                num_labels=3),
            lambda: transformers.ResNetForImageClassification, _image_batch,
            lambda m: list(m.resnet.encoder.stages), _resnet_tp,
            "a convolutional network has no sequence dim to shard (its norms are BatchNorm over the batch)"),
    )
}
