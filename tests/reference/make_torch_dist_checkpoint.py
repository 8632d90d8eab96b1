#!/usr/bin/env python3
"""Fixture for tests/reference/torch_dist_reference_test.cpp: one small Llama written twice, as
transformers saves it and as Megatron-LM's `torch_dist` checkpoint of the same weights.

    make_torch_dist_checkpoint.py OUT_DIR [--self-check] [--megatron-common-optimizer]

Needs only torch and transformers (and safetensors, which transformers brings). Deterministic
(torch.manual_seed(0); two runs give byte-identical files apart from .metadata), OMP threads 1;
about 8 s on 2 cores (10 s with --self-check), most of it imports.

OUT_DIR/hf/                 LlamaForCausalLM, fp32, save_pretrained (model.safetensors +
                            config.json): vocab 64, hidden 32, intermediate 48, 2 layers, 4 heads,
                            2 KV heads (head dim 8), max positions 128, rms eps 1e-5, rope theta
                            1e4, untied, initializer_range 0.2. The RMSNorm weights, which
                            transformers initializes to ones, are set to 1 + 0.1 * randn (same
                            generator) so that a test can tell the norms apart.
OUT_DIR/torch_dist/         latest_checkpointed_iteration.txt ("3") and iter_0000003/ with
                            metadata.json, common.pt, .metadata, __0_0.distcp, __1_0.distcp.
OUT_DIR/param_to_param_group_map/
                            what --dump-param-to-param-group-map writes: a DCP directory of
                            {global unique param name: group id}, one process.

--self-check reads everything back (see self_check()); --megatron-common-optimizer writes
common.pt's optimizer entry the way Megatron-Core really nests it (see "common.pt" below).

The torch_dist checkpoint is what Megatron-Core's GPTModel (Transformer Engine layer spec,
SwiGLU, RMSNorm, no biases, untied output layer, RoPE) saves with tensor parallelism 2,
pipeline 1, data parallel 1, --bf16 and the non-distributed mixed-precision optimizer
(Float16OptimizerWithFloat16Params around TE FusedAdam). The DCP files are written by
torch.distributed.checkpoint.save on 2 Gloo processes that this script spawns, each holding its
TP rank's chunks, with flatten_state_dict=False (so .metadata.planner_data is None, as with
Megatron's MCoreSavePlanner) and pre-serialized BYTES items (MCoreSavePlanner.transform_object).

Global tensors (L = 2 layers, layer axis first, "stacked" homogeneous layers), chunks per key:

  key (DCP fqn)                                               global shape  dtype  chunks (rank r = TP rank)
  embedding.word_embeddings.weight                            [V,H]          bf16  r: rows [32r, 32r+32)
  decoder.layers.self_attention.linear_qkv.layer_norm_weight  [L,H]          bf16  rank 0 only, one [1,H] per layer
  decoder.layers.self_attention.linear_qkv.weight             [L,(nq+2ng)d,H] bf16 r, layer i: [1,32,H] at (i,32r,0)
  decoder.layers.self_attention.linear_proj.weight            [L,H,nq*d]     bf16  r, layer i: [1,H,16] at (i,0,16r)
  decoder.layers.mlp.linear_fc1.layer_norm_weight             [L,H]          bf16  rank 0 only, per layer
  decoder.layers.mlp.linear_fc1.weight                        [L,2F,H]       bf16  r, layer i: TWO chunks, gate part
                                                                                   [1,24,H] at (i,24r,0) and up part
                                                                                   [1,24,H] at (i,F+24r,0)
  decoder.layers.mlp.linear_fc2.weight                        [L,H,F]        bf16  r, layer i: [1,H,24] at (i,0,24r)
  decoder.final_layernorm.weight                              [H]            bf16  rank 0 only
  output_layer.weight                                         [V,H]          bf16  r: rows [32r, 32r+32)
  optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>       as <key>       fp32  as <key>
  decoder.layers.{self_attention.linear_qkv,self_attention.linear_proj,mlp.linear_fc1,mlp.linear_fc2}
      ._extra_state/shard_{i}_{L}                             BYTES (rank 0): torch.save([empty uint8 tensor])
  rng_state/shard_0.{r}_1.2                                   BYTES (rank r): torch.save([[rng dict]])

Values: the HF fp32 weights W mapped as below; model tensors are W rounded to bf16,
fp32_param = W exactly, exp_avg = 0.001 * W, exp_avg_sq = (0.001 * W) ** 2 (fp32).
HF -> Megatron: embed_tokens -> embedding.word_embeddings; layers.i.input_layernorm ->
linear_qkv.layer_norm_weight[i]; q/k/v_proj -> linear_qkv[i] with per-group interleaving
(for group g = 0..ng-1: the rows of q heads g*nq/ng .. (g+1)*nq/ng-1, then k head g, then
v head g); o_proj -> linear_proj[i]; post_attention_layernorm -> linear_fc1.layer_norm_weight[i];
[gate_proj; up_proj] -> linear_fc1[i]; down_proj -> linear_fc2[i]; model.norm ->
decoder.final_layernorm; lm_head -> output_layer. No RoPE row permutation (both sides use the
rotate-half convention, Megatron's rotary_interleaved=False).

VERIFIED against Megatron-LM source (commit d98e8a64dd, paths in the repository):
- stacked layer keys `decoder.layers.<param>` with sharded offset (0, layer, num_layers) when the
  model is homogeneous and singleton_local_shards is False:
  megatron/core/transformer/transformer_block.py sharded_state_dict; the save metadata sets
  singleton_local_shards=False: megatron/training/checkpointing.py _build_sharded_state_dict_metadata.
- TP axes: column-parallel weight axis 0, row-parallel axis 1, layer_norm_weight and TENorm not TP
  sharded (replica_id (0, tp_rank, dp_rank): only TP rank 0 writes, keep_only_main_replica):
  megatron/core/extensions/transformer_engine.py (TELayerNormColumnParallelLinear,
  TERowParallelLinear .sharded_state_dict), megatron/core/transformer/utils.py
  make_sharded_tensors_for_checkpoint, megatron/core/dist_checkpointing/strategies/torch.py
  _replace_state_dict_keys_with_sharded_keys.
- SwiGLU fc1 chunks: megatron/core/transformer/mlp.py apply_swiglu_sharded_factory (not singleton):
  the rank's [gate_r; up_r] is torch.chunk'ed in two, gate goes to fragment r of 2*TP, up to
  fragment r+TP, so global dim 1 is [all gate rows; all up rows] and each rank writes 2 chunks.
- fused QKV interleaving and [gate; up] order: megatron/core/transformer/attention.py
  SelfAttention.get_query_key_value_tensors (view [.., ng, (nq/ng+2)*d], split [nq/ng*d, d, d]),
  mlp.py glu (first half silu), tools/checkpoint/loader_mixtral_hf.py set_attn_state / set_mlp_state
  (the same HF -> Megatron reshapes, no RoPE permutation).
- ShardedObject unique keys `<key>/shard_<offset>_<shape>` and the torch.save([data, ...]) value:
  megatron/core/dist_checkpointing/mapping.py ShardedObject.unique_key, strategies/torch.py
  _mcore_to_torch_sharded_object; extra-state offsets (i,) shape (L,): transformer/utils.py
  _get_extra_state_offsets; rng_state ShardedObject((pp_size, tp_size), (pp_rank, tp_rank)) with
  replica_id = dp rank: megatron/training/checkpointing.py get_rng_state.
- optimizer keys `optimizer.state.fp32_param.<key>` and `optimizer.state.<exp_avg|exp_avg_sq>.<key>`
  with the model tensor's sharding and the optimizer tensor's dtype; step not sharded:
  megatron/core/optimizer/optimizer.py Float16OptimizerWithFloat16Params.sharded_state_dict,
  megatron/core/dist_checkpointing/optimizer.py make_sharded_optimizer_tensor,
  optim_state_to_sharding_state(exclude_keys="step").
- metadata.json {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
  (dist_checkpointing/core.py save_config), latest_checkpointed_iteration.txt and iter_{:07d}
  (training/checkpointing.py), common.pt = torch.save(common state) as written by Megatron-Core
  up to 0.16 (strategies/common.py save_common; since Megatron-LM commit 40b1fd37c1,
  2026-07-08, newer versions store it inside the DCP as BYTES `common_state/shard_0_1` instead,
  while tools/checkpoint/checkpoint_inspector.py still reads common.pt).
- param groups: group 0 = parameters without overrides (weight decay), group 1 = the wd_mult=0
  override group (1-D params), fields is_expert_parallel, default_config, wd_mult, lr_mult,
  is_decoupled_lr, max_lr, min_lr: megatron/core/optimizer/__init__.py _get_param_groups;
  step in the groups (TE FusedAdam): optimizer/distrib_optimizer.py state_dict;
  opt_param_scheduler fields: megatron/core/optimizer_param_scheduler.py state_dict;
  content_metadata: _build_sharded_state_dict_metadata.
- --dump-param-to-param-group-map: dcp.save({name: group id}) with names `module.module.<GPT name>`
  and global layer numbers: megatron/core/optimizer/__init__.py get_megatron_optimizer.

CHECKED WITH megatron-core 0.16.1 from PyPI (the newest for Python 3.11), CPU, 2 Gloo ranks: the
same tensors wrapped by its own make_sharded_tensors_for_checkpoint / make_tp_sharded_tensor_for_
checkpoint / apply_swiglu_sharded_factory / make_sharded_optimizer_tensor / ShardedObject and saved
with dist_checkpointing.save give the same 46 keys, global shapes, dtypes, chunk offsets/sizes,
tensor and BYTES values, planner_data None; and its dist_checkpointing.load reads this fixture
back exactly on both TP ranks (swiglu factory merge included). Its save needed two CUDA calls
stubbed on CPU (filesystem_async.preload_tensors torch.cuda.synchronize, state_dict_saver
finalize torch.cuda.current_device). Where it differs: it writes 2 files per rank (thread_count=2
default there, 1 at HEAD), its metadata.json also has "common_backend": "torch",
"common_backend_version": 1 (HEAD drops them and ignores unknown fields on load), and its
common.pt optimizer entry is the --megatron-common-optimizer form.

ASSUMPTIONS (not what Megatron would write byte for byte):
- common.pt "optimizer" is {"param_groups": [...]} with "params" index lists, as the C++ test's
  brief asks and as checkpoint_inspector.py's first lookup (common["optimizer"]["param_groups"])
  expects. Real Megatron-Core nests it as {"optimizer": {"param_groups": [...]}} and drops "params"
  (LocalNonpersistentObject / `del param_group["params"]`); --megatron-common-optimizer writes that
  form (then the inspector's convert finds no param groups for a single optimizer).
- The TE FusedAdam group field set (lr, bias_correction, betas, eps, weight_decay, amsgrad=False,
  adam_w_mode, capturable, master_weights, step) is from memory of TE, not checked.
- args is a partial argparse.Namespace (the fields a converter/reader needs, not all ~600).
- rng_state holds CPU stand-ins (cuda_rng_state and the tracker states are CPU generator states);
  _extra_state is TE's "no FP8" value, an empty uint8 tensor (training/checkpointing.py
  _fp8_extra_state_is_persistent describes it; TE itself not checked). No rerun_state_machine
  entry (RerunStateMachine.state_dict returns None when disabled).
- padded_vocab_size = vocab_size = 64 (make_vocab_size_divisible_by 32 with TP 2: no padding).
- DCP item order inside .metadata / the files follows this script's dict order, not Megatron's.
"""

import argparse
import io
import json
import os
import random
import shutil
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties  # noqa: E402
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType  # noqa: E402

torch.set_num_threads(1)

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, MAX_POS = 64, 32, 48, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
EPS, ROPE_THETA, INIT_STD = 1e-5, 10000.0, 0.2
TP = 2
ITERATION = 3
LR, MIN_LR, WEIGHT_DECAY, BETAS, ADAM_EPS = 1e-3, 1e-4, 0.1, (0.9, 0.95), 1e-8
STATE_SCALE = 0.001

# Megatron key -> (TP kind, TP axis of the per-layer parameter, stacked over layers).
LAYOUT = {
    "embedding.word_embeddings.weight": ("tp", 0, False),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ("replicated", None, True),
    "decoder.layers.self_attention.linear_qkv.weight": ("tp", 0, True),
    "decoder.layers.self_attention.linear_proj.weight": ("tp", 1, True),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": ("replicated", None, True),
    "decoder.layers.mlp.linear_fc1.weight": ("swiglu", 0, True),
    "decoder.layers.mlp.linear_fc2.weight": ("tp", 1, True),
    "decoder.final_layernorm.weight": ("replicated", None, False),
    "output_layer.weight": ("tp", 0, False),
}
EXTRA_STATE_MODULES = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
OPTIMIZER_STATES = ["exp_avg", "exp_avg_sq"]


def group_of(key):
    """Param group id: 0 = weight decay (2-D weights), 1 = wd_mult 0 (norms)."""
    return 1 if key.endswith("layer_norm_weight") or key.endswith("final_layernorm.weight") else 0


# ---------------------------------------------------------------- the HF model and the mapping


def build_hf_model():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
        rms_norm_eps=EPS, rope_theta=ROPE_THETA, tie_word_embeddings=False, initializer_range=INIT_STD)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
    return model


def interleave_qkv(q, k, v):
    """HF q [nq*d,H], k/v [ng*d,H] -> Megatron fused rows: per group g [q heads of g; k_g; v_g]."""
    ng, per = KV_HEADS, HEADS // KV_HEADS
    return torch.cat([q.reshape(ng, per * HEAD_DIM, HIDDEN), k.reshape(ng, HEAD_DIM, HIDDEN),
                      v.reshape(ng, HEAD_DIM, HIDDEN)], dim=1).reshape(-1, HIDDEN)


def megatron_from_hf(hf):
    """{Megatron key: global fp32 tensor} (layer-stacked) from the HF state dict."""
    def stack(fn):
        return torch.stack([fn(f"model.layers.{i}.") for i in range(LAYERS)])

    return {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stack(lambda p: hf[p + "input_layernorm.weight"]),
        "decoder.layers.self_attention.linear_qkv.weight": stack(lambda p: interleave_qkv(
            hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"])),
        "decoder.layers.self_attention.linear_proj.weight": stack(lambda p: hf[p + "self_attn.o_proj.weight"]),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": stack(lambda p: hf[p + "post_attention_layernorm.weight"]),
        "decoder.layers.mlp.linear_fc1.weight": stack(lambda p: torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0)),
        "decoder.layers.mlp.linear_fc2.weight": stack(lambda p: hf[p + "mlp.down_proj.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }


# ---------------------------------------------------------------- TP chunks as Megatron makes them


def tp_local_param(kind, axis, param, tp_rank):
    """The rank's local copy of one (per-layer) parameter, as the TP model holds it."""
    if kind == "replicated":
        return param
    if kind == "swiglu":  # ColumnParallel fc1 on a rank holds [gate_r; up_r]
        gate, up = torch.chunk(param, 2, dim=0)
        return torch.cat([gate.chunk(TP, 0)[tp_rank], up.chunk(TP, 0)[tp_rank]], dim=0)
    return param.chunk(TP, axis)[tp_rank]


def rank_chunks(key, full, tp_rank):
    """[(global offsets, chunk)] that TP rank tp_rank writes for `key` (empty if it is a replica)."""
    kind, axis, stacked = LAYOUT[key]
    if kind == "replicated" and tp_rank != 0:
        return []  # replica_id (0, tp_rank, dp_rank) is not the main replica
    out = []
    for layer in range(LAYERS if stacked else 1):
        param = full[layer] if stacked else full
        local = tp_local_param(kind, axis, param, tp_rank)
        pieces = []
        if kind == "replicated":
            pieces.append(([0] * param.dim(), local))
        elif kind == "swiglu":  # mlp.py apply_swiglu_sharded_factory, singleton_local_shards=False
            w, v = torch.chunk(local, 2, dim=0)
            half = w.shape[0]
            pieces.append(([tp_rank * half, 0], w))          # fragment tp_rank of 2*TP
            pieces.append(([(tp_rank + TP) * half, 0], v))   # fragment tp_rank + TP of 2*TP
        else:
            offset = [0] * param.dim()
            offset[axis] = tp_rank * local.shape[axis]
            pieces.append((offset, local))
        for offset, t in pieces:
            if stacked:  # prepended layer axis: chunk [1, ...] at (layer, ...)
                out.append(([layer] + offset, t.unsqueeze(0)))
            else:
                out.append((offset, t))
    return out


class LocalChunks(torch.Tensor):
    """One global tensor's chunks held by this rank, for torch.distributed.checkpoint (the
    _Checkpointable protocol; the same idea as Megatron's LocalShardsContainer of
    CheckpointableShardedTensor in dist_checkpointing/strategies/checkpointable.py)."""

    @staticmethod
    def __new__(cls, global_shape, chunks):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=chunks[0][1].dtype)

    def __init__(self, global_shape, chunks):
        self._chunks = [(torch.Size(off), t.contiguous()) for off, t in chunks]

    def __create_write_items__(self, fqn, obj):
        return [
            WriteItem(index=MetadataIndex(fqn, off, i), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                  properties=TensorProperties.create_from_tensor(t),
                                                  size=self.size()))
            for i, (off, t) in enumerate(self._chunks)
        ]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self._chunks]

    def __get_tensor_shard__(self, index):
        for off, t in self._chunks:
            if off == torch.Size(index.offset):
                return t
        raise ValueError(f"no chunk of {index.fqn} at {index.offset}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"LocalChunks does not support {func}")

    def __repr__(self):
        return f"LocalChunks({tuple(self.shape)}, {len(self._chunks)} chunks)"


class MCoreLikeSavePlanner(DefaultSavePlanner):
    """BYTES values arrive already serialized (torch.save([data, ...])), as Megatron's MCoreSavePlanner."""

    def transform_object(self, write_item, object):
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def serialized(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf


def rng_state_stand_in(tp_rank):
    import numpy as np

    random.seed(1234 + tp_rank)
    np.random.seed(1234 + tp_rank)
    gen = torch.Generator().manual_seed(1234 + tp_rank)
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": gen.get_state(),
        "cuda_rng_state": gen.get_state(),  # CPU stand-in: no CUDA here
        "rng_tracker_states": {"model-parallel-rng": torch.Generator().manual_seed(2718 + tp_rank).get_state()},
    }


def rank_state_dict(tensors, tp_rank):
    """The flat DCP state dict of one TP rank (keys = Megatron's sharded keys)."""
    sd = {}
    for key in LAYOUT:  # model weights, bf16
        chunks = [(o, t.to(torch.bfloat16)) for o, t in rank_chunks(key, tensors[key], tp_rank)]
        if chunks:
            sd[key] = LocalChunks(tensors[key].shape, chunks)
    if tp_rank == 0:  # TE extra state, replica (0, tp_rank, dp_rank): only TP rank 0 writes
        for module in EXTRA_STATE_MODULES:
            for layer in range(LAYERS):
                sd[f"decoder.layers.{module}._extra_state/shard_{layer}_{LAYERS}"] = serialized(
                    [torch.empty(0, dtype=torch.uint8)])
    for state in OPTIMIZER_STATES + ["fp32_param"]:
        for key in LAYOUT:
            w = tensors[key]
            value = {"fp32_param": w, "exp_avg": STATE_SCALE * w, "exp_avg_sq": (STATE_SCALE * w) ** 2}[state]
            chunks = rank_chunks(key, value.float(), tp_rank)
            if chunks:
                sd[f"optimizer.state.{state}.{key}"] = LocalChunks(w.shape, chunks)
    sd[f"rng_state/shard_0.{tp_rank}_1.{TP}"] = serialized([[rng_state_stand_in(tp_rank)]])
    return sd


def save_rank(rank, world, store, tensors_path, iter_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tensors = torch.load(tensors_path, weights_only=True)
        sd = rank_state_dict(tensors, rank)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(iter_dir, thread_count=1),
                 planner=MCoreLikeSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- common.pt


def make_args():
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, group_query_attention=True, kv_channels=HEAD_DIM,
        padded_vocab_size=VOCAB, vocab_size=VOCAB, make_vocab_size_divisible_by=32,
        swiglu=True, gated_linear_unit=True, untie_embeddings_and_output_weights=True,
        normalization="RMSNorm", norm_epsilon=EPS, rotary_base=ROPE_THETA, rotary_percent=1.0,
        rotary_interleaved=False, position_embedding_type="rope", use_rotary_position_embeddings=True,
        max_position_embeddings=MAX_POS, seq_length=MAX_POS, add_bias_linear=False,
        add_qkv_bias=False, disable_bias_linear=True, qk_layernorm=False, init_method_std=INIT_STD,
        attention_dropout=0.0, hidden_dropout=0.0, transformer_impl="transformer_engine",
        params_dtype=torch.bfloat16, bf16=True, fp16=False, main_params_dtype=torch.float32,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1, data_parallel_size=1, world_size=TP, num_experts=None,
        sequence_parallel=False, use_distributed_optimizer=False, use_megatron_fsdp=False,
        dist_ckpt_optim_fully_reshardable=False, optimizer="adam", lr=LR, min_lr=MIN_LR,
        weight_decay=WEIGHT_DECAY, start_weight_decay=WEIGHT_DECAY, end_weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=ADAM_EPS, clip_grad=1.0,
        lr_decay_style="constant", lr_warmup_iters=0, train_iters=10, micro_batch_size=1,
        global_batch_size=2, iteration=ITERATION, consumed_train_samples=ITERATION * 2,
        ckpt_format="torch_dist", save="", load=None, no_save_optim=False, no_save_rng=False,
        data_parallel_random_init=False, tokenizer_type="NullTokenizer")


def make_param_groups(with_params):
    groups = []
    for gid, wd, wd_mult in ((0, WEIGHT_DECAY, 1.0), (1, 0.0, 0.0)):
        group = {
            "lr": LR, "bias_correction": True, "betas": BETAS, "eps": ADAM_EPS, "weight_decay": wd,
            "amsgrad": False, "adam_w_mode": True, "capturable": False, "master_weights": False,
            "is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": LR, "min_lr": MIN_LR, "step": ITERATION,
        }
        if with_params:  # torch optimizer state_dict numbering: consecutive, group by group
            sizes = [sum(1 for n in unstacked_names() if group_of(stacked_key(n)) == g) for g in (0, 1)]
            group["params"] = list(range(sum(sizes[:gid]), sum(sizes[:gid + 1])))
        groups.append(group)
    return groups


def unstacked_names():
    """GPTModel.named_parameters() order with global layer numbers."""
    yield "embedding.word_embeddings.weight"
    for i in range(LAYERS):
        for p in ("self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
                  "self_attention.linear_qkv.weight", "mlp.linear_fc1.layer_norm_weight",
                  "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
            yield f"decoder.layers.{i}.{p}"
    yield "decoder.final_layernorm.weight"
    yield "output_layer.weight"


def stacked_key(name):
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        return ".".join(parts[:2] + parts[3:])
    return name


def make_common(megatron_nesting):
    if megatron_nesting:
        optimizer = {"optimizer": {"param_groups": make_param_groups(with_params=False)}}
    else:
        optimizer = {"param_groups": make_param_groups(with_params=True)}
    return {
        "args": make_args(),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "optimizer": optimizer,
        "opt_param_scheduler": {
            "max_lr": LR, "lr_warmup_steps": 0, "num_steps": ITERATION * 2, "lr_decay_style": "constant",
            "lr_decay_steps": 20, "min_lr": MIN_LR, "start_wd": WEIGHT_DECAY, "end_wd": WEIGHT_DECAY,
            "wd_incr_style": "constant", "wd_incr_steps": 20,
        },
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    }


# ---------------------------------------------------------------- writing


def write_torch_dist(out, tensors, megatron_nesting):
    import torch.multiprocessing as mp

    root = os.path.join(out, "torch_dist")
    iter_dir = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(iter_dir)
    with tempfile.TemporaryDirectory(prefix="mkckpt-") as tmp:
        tensors_path = os.path.join(tmp, "tensors.pt")
        torch.save(tensors, tensors_path)
        mp.start_processes(save_rank, args=(TP, os.path.join(tmp, "store"), tensors_path, iter_dir),
                           nprocs=TP, join=True, start_method="spawn")
    torch.save(make_common(megatron_nesting), os.path.join(iter_dir, "common.pt"))
    with open(os.path.join(iter_dir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    return iter_dir


def write_param_map(out):
    path = os.path.join(out, "param_to_param_group_map")
    mapping = {f"module.module.{n}": group_of(stacked_key(n)) for n in unstacked_names()}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(mapping, storage_writer=dcp.FileSystemWriter(path, thread_count=1))
    return path, mapping


# ---------------------------------------------------------------- self check


def load_dcp(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="mkckpt-check-") as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
        return torch.load(os.path.join(tmp, "all.pt"), weights_only=False)


def megatron_forward(t, ids):
    """GPTModel forward in fp32 from Megatron tensors (stacked keys), written from Megatron's code
    (attention.py get_query_key_value_tensors, mlp.py glu, RMSNorm, rotate-half RoPE)."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    s = ids.shape[1]
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()

    def rope(x):  # [b, s, heads, d]
        x1, x2 = x.chunk(2, -1)
        return x * cos[None, :, None] + torch.cat([-x2, x1], -1) * sin[None, :, None]

    ng, per = KV_HEADS, HEADS // KV_HEADS
    h = t["embedding.word_embeddings.weight"][ids]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(LAYERS):
        x = rms(h, t["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i])
        mixed = x @ t["decoder.layers.self_attention.linear_qkv.weight"][i].T
        mixed = mixed.view(*mixed.shape[:-1], ng, (per + 2) * HEAD_DIM)
        q, k, v = torch.split(mixed, [per * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
        q = rope(q.reshape(*q.shape[:2], HEADS, HEAD_DIM))
        k, v = rope(k), v  # [b, s, ng, d]
        k = k.repeat_interleave(per, dim=2)
        v = v.repeat_interleave(per, dim=2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM ** 0.5 + mask
        ctx = torch.einsum("bhqk,bkhd->bqhd", att.softmax(-1), v).reshape(*h.shape[:2], HEADS * HEAD_DIM)
        h = h + ctx @ t["decoder.layers.self_attention.linear_proj.weight"][i].T
        x = rms(h, t["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i])
        glu, lin = torch.chunk(x @ t["decoder.layers.mlp.linear_fc1.weight"][i].T, 2, -1)
        h = h + (torch.nn.functional.silu(glu) * lin) @ t["decoder.layers.mlp.linear_fc2.weight"][i].T
    return rms(h, t["decoder.final_layernorm.weight"]) @ t["output_layer.weight"].T


def self_check(out):
    """Reads the outputs back with torch and transformers; raises on any mismatch."""
    import transformers
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    hf = load_file(os.path.join(out, "hf", "model.safetensors"))
    iter_dir = os.path.join(out, "torch_dist", f"iter_{ITERATION:07d}")
    problems = []

    def expect(cond, what):
        if not cond:
            problems.append(what)

    # Files.
    expect(sorted(os.listdir(iter_dir)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"],
           f"iter dir files {sorted(os.listdir(iter_dir))}")
    with open(os.path.join(out, "torch_dist", "latest_checkpointed_iteration.txt")) as f:
        expect(f.read() == "3", "tracker file")

    # .metadata: keys, global shapes, dtypes, chunks.
    md = FileSystemReader(iter_dir).read_metadata()
    expect(md.planner_data is None, "planner_data should be None (flatten_state_dict=False)")
    dims = {"embedding.word_embeddings.weight": [VOCAB, HIDDEN],
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": [LAYERS, HIDDEN],
            "decoder.layers.self_attention.linear_qkv.weight": [LAYERS, (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN],
            "decoder.layers.self_attention.linear_proj.weight": [LAYERS, HIDDEN, HEADS * HEAD_DIM],
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": [LAYERS, HIDDEN],
            "decoder.layers.mlp.linear_fc1.weight": [LAYERS, 2 * FFN, HIDDEN],
            "decoder.layers.mlp.linear_fc2.weight": [LAYERS, HIDDEN, FFN],
            "decoder.final_layernorm.weight": [HIDDEN],
            "output_layer.weight": [VOCAB, HIDDEN]}
    chunk_count = {"tp": 2, "replicated": 1, "swiglu": 4}
    expected_keys = set()
    for key, shape in dims.items():
        kind, _, stacked = LAYOUT[key]
        for prefix, dtype in [("", torch.bfloat16)] + [(f"optimizer.state.{s}.", torch.float32)
                                                      for s in OPTIMIZER_STATES + ["fp32_param"]]:
            k = prefix + key
            expected_keys.add(k)
            m = md.state_dict_metadata.get(k)
            if not isinstance(m, TensorStorageMetadata):
                problems.append(f"{k}: missing or not a tensor")
                continue
            expect(list(m.size) == shape, f"{k}: size {list(m.size)} != {shape}")
            expect(m.properties.dtype == dtype, f"{k}: dtype {m.properties.dtype}")
            n = chunk_count[kind] * (LAYERS if stacked else 1)
            expect(len(m.chunks) == n, f"{k}: {len(m.chunks)} chunks, expected {n}")
            volume = sum(torch.Size(c.sizes).numel() for c in m.chunks)
            expect(volume == torch.Size(shape).numel(), f"{k}: chunks cover {volume} elements")
    fc1 = md.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"]
    expect(sorted((tuple(c.offsets), tuple(c.sizes)) for c in fc1.chunks) ==
           sorted(((i, o, 0), (1, FFN // TP, HIDDEN)) for i in range(LAYERS) for o in range(0, 2 * FFN, FFN // TP)),
           "fc1 chunks are not the swiglu factory's")
    qkv = md.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    expect(sorted((tuple(c.offsets), tuple(c.sizes)) for c in qkv.chunks) ==
           sorted(((i, r * 32, 0), (1, 32, HIDDEN)) for i in range(LAYERS) for r in range(TP)), "qkv chunks")
    proj = md.state_dict_metadata["decoder.layers.self_attention.linear_proj.weight"]
    expect(sorted(tuple(c.offsets) for c in proj.chunks) ==
           sorted((i, 0, 16 * r) for i in range(LAYERS) for r in range(TP)),
           "linear_proj chunks")
    bytes_keys = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    expect(bytes_keys == {f"decoder.layers.{m}._extra_state/shard_{i}_{LAYERS}" for m in EXTRA_STATE_MODULES
                          for i in range(LAYERS)} | {f"rng_state/shard_0.{r}_1.{TP}" for r in range(TP)},
           f"BYTES keys {sorted(bytes_keys)}")
    expect(set(md.state_dict_metadata) == expected_keys | bytes_keys, "unexpected keys")

    # Values: unstack, de-interleave, split fc1 -> the HF tensors.
    sd = load_dcp(iter_dir)

    def to_hf(get):
        res = {"model.embed_tokens.weight": get("embedding.word_embeddings.weight"),
               "model.norm.weight": get("decoder.final_layernorm.weight"),
               "lm_head.weight": get("output_layer.weight")}
        per = HEADS // KV_HEADS
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            res[p + "input_layernorm.weight"] = get("decoder.layers.self_attention.linear_qkv.layer_norm_weight")[i]
            res[p + "post_attention_layernorm.weight"] = get("decoder.layers.mlp.linear_fc1.layer_norm_weight")[i]
            fused = get("decoder.layers.self_attention.linear_qkv.weight")[i]
            fused = fused.view(KV_HEADS, (per + 2) * HEAD_DIM, HIDDEN)
            q, k, v = torch.split(fused, [per * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=1)
            res[p + "self_attn.q_proj.weight"] = q.reshape(-1, HIDDEN)
            res[p + "self_attn.k_proj.weight"] = k.reshape(-1, HIDDEN)
            res[p + "self_attn.v_proj.weight"] = v.reshape(-1, HIDDEN)
            res[p + "self_attn.o_proj.weight"] = get("decoder.layers.self_attention.linear_proj.weight")[i]
            gate, up = torch.chunk(get("decoder.layers.mlp.linear_fc1.weight")[i], 2, dim=0)
            res[p + "mlp.gate_proj.weight"], res[p + "mlp.up_proj.weight"] = gate, up
            res[p + "mlp.down_proj.weight"] = get("decoder.layers.mlp.linear_fc2.weight")[i]
        return res

    checks = [("", lambda w: w.to(torch.bfloat16), torch.bfloat16),
              ("optimizer.state.fp32_param.", lambda w: w, torch.float32),
              ("optimizer.state.exp_avg.", lambda w: STATE_SCALE * w, torch.float32),
              ("optimizer.state.exp_avg_sq.", lambda w: (STATE_SCALE * w) ** 2, torch.float32)]
    for prefix, expected_fn, dtype in checks:
        got = to_hf(lambda k: sd[prefix + k])
        expect(set(got) == set(hf), f"{prefix}: HF names differ")
        for name, w in hf.items():
            g = got.get(name)
            ok = g is not None and g.dtype == dtype and g.shape == w.shape and torch.equal(g, expected_fn(w))
            expect(ok, f"{prefix or 'model '}{name}: not equal to the HF tensor")
    # TP rank 1's qkv chunk holds exactly KV group 1 (q heads 2,3, k head 1, v head 1).
    l0 = hf["model.layers.0.self_attn.q_proj.weight"]
    expect(torch.equal(sd["optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight"][0, 32:48],
                       l0[16:32]), "qkv: rank 1's rows 0..15 are not q heads 2,3")
    for k, v in sd.items():
        if "_extra_state" in k:
            expect(isinstance(v, list) and v[0].numel() == 0 and v[0].dtype == torch.uint8, f"{k}: {v!r}")
        if k.startswith("rng_state"):
            expect(isinstance(v, list) and isinstance(v[0], list) and "torch_rng_state" in v[0][0], f"{k}")

    # Semantics: Megatron's forward on the checkpoint == transformers' logits.
    model = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    ids = (torch.arange(2 * 9) * 7 + 3).remainder(VOCAB).view(2, 9)
    with torch.no_grad():
        ref = model(ids).logits
    fp32 = "optimizer.state.fp32_param."
    mt = {k[len(fp32):]: v for k, v in sd.items() if k.startswith(fp32)}
    diff = (megatron_forward(mt, ids) - ref).abs().max().item()
    expect(diff < 1e-4, f"Megatron-style forward differs from transformers by {diff}")

    # common.pt
    common = torch.load(os.path.join(iter_dir, "common.pt"), weights_only=False)
    a = common["args"]
    expect(isinstance(a, argparse.Namespace) and a.num_query_groups == KV_HEADS and a.params_dtype == torch.bfloat16,
           "common.pt args")
    expect(common["iteration"] == ITERATION and common["checkpoint_version"] == 3.0, "common.pt iteration/version")
    groups = common["optimizer"]["param_groups"] if "param_groups" in common["optimizer"] else \
        common["optimizer"]["optimizer"]["param_groups"]
    expect([g["weight_decay"] for g in groups] == [WEIGHT_DECAY, 0.0] and all(g["step"] == ITERATION for g in groups),
           "common.pt param groups")

    # param_to_param_group_map
    pmap = load_dcp(os.path.join(out, "param_to_param_group_map"))
    expect(len(pmap) == 3 + 6 * LAYERS and pmap["module.module.decoder.layers.1.self_attention.linear_qkv.weight"] == 0
           and pmap["module.module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == 1
           and pmap["module.module.decoder.final_layernorm.weight"] == 1, f"param map {pmap}")

    if problems:
        raise SystemExit("self-check FAILED:\n  " + "\n  ".join(problems))
    print(f"self-check: OK ({len(md.state_dict_metadata)} DCP keys, HF tensors recovered exactly, "
          f"Megatron-style forward vs transformers max |diff| {diff:.2e})")


# ---------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--self-check", action="store_true", help="read everything back and compare")
    parser.add_argument("--megatron-common-optimizer", action="store_true",
                        help='common.pt optimizer = {"optimizer": {"param_groups": [...]}} without "params"')
    opts = parser.parse_args()
    start = time.time()
    out = os.path.abspath(opts.out_dir)
    for sub in ("hf", "torch_dist", "param_to_param_group_map"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    os.makedirs(out, exist_ok=True)

    model = build_hf_model()
    model.save_pretrained(os.path.join(out, "hf"))
    hf = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    print(f"hf: {out}/hf LlamaForCausalLM fp32, {len(hf)} tensors, "
          f"{sum(v.numel() for v in hf.values())} params (model.safetensors, config.json)")

    tensors = megatron_from_hf(hf)
    iter_dir = write_torch_dist(out, tensors, opts.megatron_common_optimizer)
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(iter_dir).read_metadata()
    n_chunks = sum(len(getattr(v, "chunks", [])) for v in md.state_dict_metadata.values())
    print(f"torch_dist: {iter_dir} iteration {ITERATION}, TP={TP} (2 Gloo ranks), "
          f"{len(md.state_dict_metadata)} DCP keys "
          f"({n_chunks} tensor chunks), bf16 weights + fp32 fp32_param/exp_avg/exp_avg_sq, common.pt, metadata.json")

    path, mapping = write_param_map(out)
    print(f"param_to_param_group_map: {path} {len(mapping)} params, "
          f"{sum(1 for v in mapping.values() if v == 0)} in group 0 (weight decay), "
          f"{sum(1 for v in mapping.values() if v == 1)} in group 1 (norms)")

    if opts.self_check:
        self_check(out)
    print(f"done in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
