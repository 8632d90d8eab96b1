#!/usr/bin/env python3
"""Fixture for tests/reference/torch_dist_reference_test.cpp: one small Llama (or, with --moe, a
mixture-of-experts GPT) written twice, as transformers saves it and as Megatron-LM's
`torch_dist` checkpoint of the same weights.

    make_torch_dist_checkpoint.py OUT_DIR [--self-check] [--megatron-common-optimizer]
                                  [--moe grouped|sequential] [--tensor-parallel 1|2|4]

Needs only torch and transformers (and safetensors, which transformers brings). Deterministic
(torch.manual_seed(0); two runs give byte-identical files apart from .metadata), OMP threads 1;
about 5 s on 2 cores, most of it imports.

OUT_DIR/hf/                 LlamaForCausalLM, fp32, save_pretrained (model.safetensors +
                            config.json): vocab 64, hidden 32, intermediate 48, 2 layers, 4 heads,
                            2 KV heads (head dim 8), max positions 128, rms eps 1e-5, rope theta
                            1e4, untied, initializer_range 0.2. The RMSNorm weights, which
                            transformers initializes to ones, are set to 1 + 0.1 * randn (same
                            generator) so that a test can tell the norms apart.
OUT_DIR/torch_dist/         latest_checkpointed_iteration.txt ("3") and iter_0000003/ with
                            metadata.json, common.pt, .metadata, __0_0.distcp, __1_0.distcp
                            (one __<r>_0.distcp per TP rank r: see --tensor-parallel).
OUT_DIR/param_to_param_group_map/
                            what --dump-param-to-param-group-map writes: a DCP directory of
                            {global unique param name: group id}, one process.
OUT_DIR/reference_logits.safetensors
                            "input_ids" [2, 9] int64 and transformers' fp32 "logits" [2, 9, 64] of
                            the HF model on them (eager attention).

--self-check reads everything back (see self_check()); --megatron-common-optimizer writes
common.pt's optimizer entry the way Megatron-Core really nests it (see "common.pt" below);
--moe writes the mixture-of-experts model described under "Mixture of experts" below.
--tensor-parallel N (dense model only; default 2, what the rest of this docstring describes)
saves the same global tensors and values as Megatron with tensor parallelism N (the same keys
but rng_state, one per TP rank: rng_state/shard_0.<r>_1.<N>), on N Gloo
processes, one __<r>_0.distcp per TP rank r: N = 1 (every tensor one chunk in __0_0.distcp, fc1
still two, gate and up: apply_swiglu_sharded_factory with axis_frag 1), 2, or 4 (4 heads over 4
ranks with 2 query groups: Megatron's num_query_groups < TP case, allowed when TP is a multiple
of num_query_groups (transformer_config.py), attention.py Attention.__init__ and
get_query_key_value_tensors: linear_qkv is still a plain column-parallel linear of the global
group-interleaved rows, so a rank's 16 rows are half a group, "q1 q2" or "k1 v1"). Only N = 2 was
run through megatron-core (below); N = 1 and 4 take the same code paths with another TP size.
The chunk sizes below then read 64/N (vocab, qkv rows), 32/N (linear_proj columns) and 48/N (fc1
gate / up part, fc2 columns); args say tensor_model_parallel_size = world_size = N and
make_vocab_size_divisible_by = 64 / N (so padded_vocab_size stays 64: Megatron pads the vocab
to a multiple of make_vocab_size_divisible_by * TP).

The torch_dist checkpoint is what Megatron-Core's GPTModel (Transformer Engine layer spec,
SwiGLU, RMSNorm, no biases, untied output layer, RoPE) saves with tensor parallelism 2,
pipeline 1, data parallel 1, --bf16 and the non-distributed mixed-precision optimizer
(Float16OptimizerWithFloat16Params around TE FusedAdam). The DCP files are written by
torch.distributed.checkpoint.save on 2 Gloo processes that this script forks, each holding its
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

Mixture of experts (--moe)
--------------------------
The same 2 processes are tensor parallel 2 for the dense part and expert parallel 2 with expert
tensor parallelism 1 for the experts (Megatron's "MoE parallel folding":
--expert-model-parallel-size 2 --expert-tensor-parallel-size 1; data and expert-data parallel 1):
rank r is TP rank r and EP rank r and holds experts [2r, 2r+2) of every MoE layer. E = 4 experts,
top 2, expert width Fe = 16, softmax router, --sequence-parallel (MoELayer.forward wants it with
TP > 1 in training; it changes no key or chunk), no expert bias. Two models:

  --moe grouped     Qwen3MoeForCausalLM (q/k RMSNorm, --qk-layernorm), both layers MoE, TEGroupedMLP
                    (--moe-grouped-gemm), the top-k weights renormalised (norm_topk_prob true).
  --moe sequential  Qwen2MoeForCausalLM without q/k/v biases, a gated shared expert of width
                    Fs = 24 (--moe-shared-expert-intermediate-size 24 --moe-shared-expert-gate),
                    layer 0 MoE and layer 1 dense (mlp_only_layers [1], --moe-layer-freq [1,0]),
                    SequentialMLP, not renormalised (norm_topk_prob false, --moe-router-pre-softmax).

TEGroupedMLP and SequentialMLP write the same torch_dist tensors (experts.py: "interchangeable");
what differs is the model's parameter names, which the param map (and an fsdp_dtensor
checkpoint) uses: grouped `mlp.experts.linear_fc1.weight<e>`, sequential
`mlp.experts.local_experts.<e>.linear_fc1.weight`, e the global expert index. The two models also
differ in layer pattern so that between them they cover both key layouts: all layers MoE is a
homogeneous block (stacked keys `decoder.layers.<rest>` with the layer axis first, as the dense
model); a dense layer among MoE layers is not, so every key names its global layer,
`decoder.layers.<i>.<rest>`, with no layer axis.

  <rest>                                  per-layer shape  dtype  chunks (rank r)
  self_attention.linear_qkv.layer_norm_weight, self_attention.linear_qkv.weight,
  self_attention.linear_proj.weight       as dense
  self_attention.{q,k}_layernorm.weight   [d]              bf16   rank 0 only (grouped)
  pre_mlp_layernorm.weight                [H]              bf16   rank 0 only (MoE layers)
  mlp.router.weight                       [E,H]            bf16   rank 0 only (not TP sharded)
  mlp.experts.experts.linear_fc1.weight   [E,2Fe,H]        bf16   the owner (EP rank e // 2) of expert e:
                                                                  TWO chunks [1,Fe,H], gate part at (e,0,0),
                                                                  up part at (e,Fe,0)
  mlp.experts.experts.linear_fc2.weight   [E,H,Fe]         bf16   the owner: [1,H,Fe] at (e,0,0)
  mlp.shared_experts.linear_fc1.weight    [2Fs,H]          bf16   r: gate part [Fs/2,H] at (r Fs/2,0), up part
                                                                  [Fs/2,H] at (Fs + r Fs/2,0) (sequential)
  mlp.shared_experts.linear_fc2.weight    [H,Fs]           bf16   r: [H,Fs/2] at (0,r Fs/2)
  mlp.shared_experts.gate_weight          [1,H]            bf16   rank 0 only
  mlp.linear_fc1.layer_norm_weight, mlp.linear_fc1.weight, mlp.linear_fc2.weight
                                          as dense (the dense layer 1 of sequential)
  Stacked keys prepend the layer axis to shapes and offsets: linear_fc1 [L,E,2Fe,H] with chunks
  [1,1,Fe,H] at (i,e,0,0) and (i,e,Fe,0).
  optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>   as <key>, fp32.
  <module>._extra_state/shard_<offsets>_<shape>   BYTES, torch.save([empty uint8 tensor]): the
      experts' linear_fc1 / linear_fc2 written by their owner, offsets (layer, expert) of (L, E)
      joined by dots when stacked ("shard_1.3_2.4": layer 1, expert 3), (expert) of (E) per layer
      ("shard_3_4"); linear_qkv, linear_proj, the dense
      layer's and the shared expert's linear_fc1 / linear_fc2 by rank 0, "shard_<i>_<L>" stacked,
      "shard_0_1" per layer.

HF -> Megatron beyond the dense mapping: post_attention_layernorm -> pre_mlp_layernorm (MoE
layers); mlp.gate -> mlp.router; experts.<e>.[gate_proj; up_proj] -> linear_fc1[e];
experts.<e>.down_proj -> linear_fc2[e]; shared_expert.[gate_proj; up_proj] ->
shared_experts.linear_fc1; shared_expert.down_proj -> shared_experts.linear_fc2;
shared_expert_gate -> shared_experts.gate_weight; self_attn.{q,k}_norm -> {q,k}_layernorm.
(transformers 5 holds a layer's experts fused, experts.gate_up_proj [E, 2Fe, H]; its
save_pretrained writes the per-expert names used here, which mfsdp's names are.)

common.pt with --moe: args as dense plus num_experts 4, moe_router_topk 2, moe_ffn_hidden_size
16, moe_grouped_gemm, moe_layer_freq (1, or [1, 0]), expert_model_parallel_size 2,
expert_tensor_parallel_size 1, qk_layernorm, moe_shared_expert_intermediate_size,
moe_shared_expert_gate, moe_router_pre_softmax, sequence_parallel. Megatron builds two optimizers,
dense and expert-parallel, under a ChainedOptimizer: group 2 is the expert group
(is_expert_parallel true, weight decay; every expert parameter), groups 0 and 1 the dense ones.
--megatron-common-optimizer writes ChainedOptimizer's {0: {"optimizer": {"param_groups": [g0, g1]}},
1: {"optimizer": {"param_groups": [g2]}}}; otherwise {"param_groups": [g0, g1, g2]} with "params".
The param map names experts by the model's names with global layer and expert indices.

VERIFIED for --moe against the same Megatron-LM commit (d98e8a64ddf3, 2026-08-22):
- MoELayer has no sharded_state_dict of its own: MegatronModule.sharded_state_dict recurses into
  router, experts and shared_experts with prefix `<layer>.mlp.<child>.`
  (megatron/core/transformer/module.py, megatron/core/transformer/moe/moe_layer.py).
- the expert key `...mlp.experts.experts.<linear>.<param>` ("experts" twice) and the expert axis:
  TEGroupedMLP.sharded_state_dict renames `linear_fc1.` to f'{prefix}experts.linear_fc1.' where
  prefix is `...mlp.experts.`, and TEGroupedLinear._sharded_state_dict_grouped
  (megatron/core/extensions/transformer_engine.py) gives every gemm the key `<linear>.weight`
  with the appended offset (len(sharded_offsets), ep_rank * num_local_experts + gemm,
  ep_size * num_local_experts); SequentialMLP.sharded_state_dict renames
  `local_experts.<j>.` to `experts.` with the same offset (megatron/core/transformer/moe/experts.py).
  Which of the two a model has: TESpecProvider.grouped_mlp_modules, TEGroupedMLP with
  --moe-grouped-gemm (megatron/core/extensions/transformer_engine_spec_provider.py).
  megatron/core/export/trtllm/model_to_trllm_mapping/default_conversion_dict.py names
  `decoder.layers.mlp.experts.experts.linear_fc1.weight` too.
- expert fc1 SwiGLU chunks: apply_swiglu_sharded_factory (mlp.py) over the offsets that include
  the expert axis, expert TP 1: fragments 0 and 1 of 2 along the expert's own axis 0.
- replica ids: experts (pp, expert-TP rank, expert-DP rank), so every EP rank writes its own
  experts (TEGroupedLinear._sharded_state_dict_grouped, SequentialMLP.sharded_state_dict);
  router, norms and shared-expert gate are not TP sharded (make_sharded_tensors_for_checkpoint
  without a TP axis), so only TP rank 0 writes them; the shared expert is a TP-sharded MLP
  (moe/shared_experts.py SharedExpertMLP, gate_weight [1, H] in its sharded_state_dict).
- expert extra state: one ShardedObject per gemm with offsets from _get_extra_state_offsets
  (transformer/utils.py): (i, e) of (L, E).
- layout choice: TransformerBlock.sharded_state_dict (transformer/transformer_block.py) sets
  non_homogeneous_layers when moe_layer_freq is a list or an int > 1; then the sharded prefix is
  `decoder.layers.<global layer>.` with no layer offset, else `decoder.layers.` with (0, layer, L).
- pre_mlp_layernorm is a TENorm in MoE layers and absent in dense ones, whose norm is fused into
  linear_fc1 (models/gpt/gpt_layer_specs.py get_gpt_layer_with_transformer_engine_submodules,
  get_gpt_decoder_layer_specs: dense layers of a mixed model take the dense spec);
  q/k_layernorm are TENorms over the head dim.
- router weight [E, H] in params_dtype; expert_bias an fp32 buffer only with
  --moe-router-enable-expert-bias (moe/router.py Router.__init__, TopKRouter.__init__).
- dense and expert optimizers under a ChainedOptimizer (optimizer/__init__.py
  get_megatron_optimizer: dense param groups first, then the expert ones); its common state
  {0: ..., 1: ...} and no `chained_<i>.` key prefix for a non-distributed optimizer with
  chained_optim_avoid_prefix (optimizer/optimizer.py ChainedOptimizer.sharded_state_dict).
- param map names with global expert indices: get_global_unique_param_name ->
  handle_experts_in_state_dict (transformer/fsdp_dtensor_checkpoint.py); Megatron-FSDP names
  the SwiGLU halves `<name>_w` / `<name>_v` there too (handle_swiglu_in_state_dict), and
  tools/checkpoint/checkpoint_inspector.py split_expert_weights names a split expert tensor
  `.experts.<linear>.weight<e>`.
- router semantics: topk_softmax_with_capacity (moe/moe_utils.py): softmax of the top-k logits,
  or with pre-softmax the top-k of the softmax over every expert; the shared expert's output
  times sigmoid(x gate_weight^T) (shared_experts.py).

ASSUMPTIONS for --moe (besides the dense ones): not checked with megatron-core (the dense layout
was); the grouped experts' TE extra state is the same "no FP8" value per gemm; Megatron would
write the same tensors with --ckpt-fully-parallel-save (data parallel 1: one writer per chunk
either way).
"""

import argparse
import io
import itertools
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
TP = 2  # --tensor-parallel (set_tensor_parallel); the MoE models need 2 (their EP ranks)
TP_CHOICES = (1, 2, 4)
ITERATION = 3
LR, MIN_LR, WEIGHT_DECAY, BETAS, ADAM_EPS = 1e-3, 1e-4, 0.1, (0.9, 0.95), 1e-8
STATE_SCALE = 0.001
# --moe: the same TP ranks are the expert-parallel ranks (expert TP 1).
EXPERTS, TOPK, MOE_FFN, SHARED_FFN, EP = 4, 2, 16, 24, 2
OPTIMIZER_STATES = ["exp_avg", "exp_avg_sq"]
REFERENCE_IDS = (torch.arange(2 * 9) * 7 + 3).remainder(VOCAB).view(2, 9)


def set_tensor_parallel(tp):
    """--tensor-parallel: Megatron needs heads, FFN and the padded vocab divisible by TP."""
    global TP
    assert tp in TP_CHOICES and HEADS % tp == 0 and FFN % tp == 0 and VOCAB % tp == 0, tp
    TP = tp


class Model:
    """Which model the fixture writes: the dense Llama (moe None) or one of the two MoE models."""

    def __init__(self, moe=None):
        self.moe = moe
        self.moe_layers = {None: [False] * LAYERS, "grouped": [True] * LAYERS, "sequential": [True, False]}[moe]
        self.qk_norm = moe == "grouped"     # Qwen3-MoE
        self.shared = moe == "sequential"   # Qwen2-MoE's gated shared expert
        self.grouped = moe == "grouped"     # TEGroupedMLP's parameter names, else SequentialMLP's
        self.pre_softmax = moe == "sequential"  # norm_topk_prob false
        # transformer_block.py: a block of one layer kind is stacked, a mixed one is not.
        self.stacked = len(set(self.moe_layers)) == 1

    def layer_key(self, i, rest):
        return f"decoder.layers.{rest}" if self.stacked else f"decoder.layers.{i}.{rest}"


def group_of(name):
    """Param group id: 0 = weight decay (dense weights), 1 = wd_mult 0 (norms), 2 = the expert
    optimizer's group (every expert weight)."""
    if ".mlp.experts." in name:
        return 2
    return 1 if name.endswith("layer_norm_weight") or name.endswith("layernorm.weight") else 0


# ---------------------------------------------------------------- the HF model and the mapping


def build_hf_model(model):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                  rms_norm_eps=EPS, rope_theta=ROPE_THETA, tie_word_embeddings=False, initializer_range=INIT_STD)
    moe = dict(num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=MOE_FFN,
               norm_topk_prob=not model.pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(LAYERS) if not model.moe_layers[i]])
    if model.moe is None:
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    elif model.moe == "grouped":
        cls, config = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(**common, **moe, head_dim=HEAD_DIM)
    else:
        cls, config = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=SHARED_FFN, qkv_bias=False)
    torch.manual_seed(0)
    hf_model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
    return hf_model


def interleave_qkv(q, k, v):
    """HF q [nq*d,H], k/v [ng*d,H] -> Megatron fused rows: per group g [q heads of g; k_g; v_g]."""
    ng, per = KV_HEADS, HEADS // KV_HEADS
    return torch.cat([q.reshape(ng, per * HEAD_DIM, HIDDEN), k.reshape(ng, HEAD_DIM, HIDDEN),
                      v.reshape(ng, HEAD_DIM, HIDDEN)], dim=1).reshape(-1, HIDDEN)


def layer_params(model, i):
    """[(Megatron name in layer i, TP kind, TP axis, has an expert axis, HF state dict -> tensor)]."""
    p = f"model.layers.{i}."

    def swiglu(prefix):
        return lambda hf: torch.cat([hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]], dim=0)

    def experts(fn):  # the per-expert tensors of layer i, stacked on a leading expert axis
        return lambda hf: torch.stack([fn(f"{p}mlp.experts.{e}.")(hf) for e in range(EXPERTS)])

    out = [("self_attention.linear_qkv.layer_norm_weight", "replicated", None, False,
            lambda hf: hf[p + "input_layernorm.weight"]),
           ("self_attention.linear_qkv.weight", "tp", 0, False, lambda hf: interleave_qkv(
               hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"]))]
    if model.qk_norm:
        out += [("self_attention.q_layernorm.weight", "replicated", None, False, lambda hf: hf[p + "self_attn.q_norm.weight"]),
                ("self_attention.k_layernorm.weight", "replicated", None, False, lambda hf: hf[p + "self_attn.k_norm.weight"])]
    out.append(("self_attention.linear_proj.weight", "tp", 1, False, lambda hf: hf[p + "self_attn.o_proj.weight"]))
    if not model.moe_layers[i]:
        return out + [
            ("mlp.linear_fc1.layer_norm_weight", "replicated", None, False, lambda hf: hf[p + "post_attention_layernorm.weight"]),
            ("mlp.linear_fc1.weight", "swiglu", 0, False, swiglu(p + "mlp.")),
            ("mlp.linear_fc2.weight", "tp", 1, False, lambda hf: hf[p + "mlp.down_proj.weight"])]
    out += [("pre_mlp_layernorm.weight", "replicated", None, False, lambda hf: hf[p + "post_attention_layernorm.weight"]),
            ("mlp.router.weight", "replicated", None, False, lambda hf: hf[p + "mlp.gate.weight"]),
            ("mlp.experts.experts.linear_fc1.weight", "swiglu", 0, True, experts(swiglu)),
            ("mlp.experts.experts.linear_fc2.weight", "tp", 1, True,
             experts(lambda e: lambda hf: hf[e + "down_proj.weight"]))]
    if model.shared:
        out += [("mlp.shared_experts.linear_fc1.weight", "swiglu", 0, False, swiglu(p + "mlp.shared_expert.")),
                ("mlp.shared_experts.linear_fc2.weight", "tp", 1, False, lambda hf: hf[p + "mlp.shared_expert.down_proj.weight"]),
                ("mlp.shared_experts.gate_weight", "replicated", None, False, lambda hf: hf[p + "mlp.shared_expert_gate.weight"])]
    return out


def megatron_layout(model):
    """{Megatron key: (TP kind, TP axis of the per-layer parameter, leading axes, HF -> global tensor)};
    the leading axes, before the parameter's own, are "layer" (stacked keys) and "expert"."""
    per_layer = [layer_params(model, i) for i in range(LAYERS)]
    out = {"embedding.word_embeddings.weight": ("tp", 0, (), lambda hf: hf["model.embed_tokens.weight"])}
    if model.stacked:
        for j, (name, kind, axis, expert, _) in enumerate(per_layer[0]):
            stack = (lambda j: lambda hf: torch.stack([per_layer[i][j][4](hf) for i in range(LAYERS)]))(j)
            out["decoder.layers." + name] = (kind, axis, ("layer", "expert") if expert else ("layer",), stack)
    else:
        for i in range(LAYERS):
            for name, kind, axis, expert, fn in per_layer[i]:
                out[f"decoder.layers.{i}.{name}"] = (kind, axis, ("expert",) if expert else (), fn)
    out["decoder.final_layernorm.weight"] = ("replicated", None, (), lambda hf: hf["model.norm.weight"])
    out["output_layer.weight"] = ("tp", 0, (), lambda hf: hf["lm_head.weight"])
    return out


def megatron_from_hf(hf, model):
    """{Megatron key: global fp32 tensor} from the HF state dict."""
    return {key: entry[3](hf) for key, entry in megatron_layout(model).items()}


# ---------------------------------------------------------------- chunks as Megatron makes them


def param_pieces(kind, axis, param, tp_size, tp_rank):
    """[(offsets in the parameter, piece)] that tp_rank of tp_size writes of one parameter."""
    if kind == "replicated":
        return [([0] * param.dim(), param)]
    if kind == "swiglu":  # mlp.py apply_swiglu_sharded_factory, singleton_local_shards=False:
        gate, up = torch.chunk(param, 2, dim=0)  # the rank holds [gate_r; up_r]
        w, v = gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]
        half = w.shape[0]
        return [([tp_rank * half, 0], w),               # fragment tp_rank of 2*tp_size
                ([(tp_rank + tp_size) * half, 0], v)]   # fragment tp_rank + tp_size of 2*tp_size
    local = param.chunk(tp_size, axis)[tp_rank]
    offset = [0] * param.dim()
    offset[axis] = tp_rank * local.shape[axis]
    return [(offset, local)]


def rank_chunks(layout, key, full, rank):
    """[(global offsets, chunk)] that `rank` writes for `key` (empty where it holds a replica)."""
    kind, axis, lead = layout[key][:3]
    expert_axis = lead.index("expert") if "expert" in lead else None
    # Experts: expert TP 1, EP rank = rank; the rest: TP rank = rank.
    tp_size, tp_rank = (1, 0) if expert_axis is not None else (TP, rank)
    out = []
    for index in itertools.product(*(range(n) for n in full.shape[:len(lead)])):
        if expert_axis is not None and index[expert_axis] // (EXPERTS // EP) != rank:
            continue  # another EP rank's expert
        if expert_axis is None and kind == "replicated" and rank != 0:
            continue  # replica_id (0, tp_rank, dp_rank) is not the main replica
        param = full[index] if index else full
        for offset, t in param_pieces(kind, axis, param, tp_size, tp_rank):
            # leading axes: chunk [1, ..., piece] at (index..., offset...)
            out.append((list(index) + offset, t.reshape((1,) * len(index) + tuple(t.shape))))
    return out


def extra_state_keys(model, rank):
    """The ShardedObject keys of TE's _extra_state that `rank` writes."""
    def modules(i):
        dense = ["self_attention.linear_qkv", "self_attention.linear_proj"]
        if not model.moe_layers[i]:
            return dense + ["mlp.linear_fc1", "mlp.linear_fc2"], []
        shared = ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"] if model.shared else []
        return dense + shared, ["mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"]

    mine = [e for e in range(EXPERTS) if e // (EXPERTS // EP) == rank]
    keys = []
    if model.stacked:
        dense, experts = modules(0)
        if rank == 0:
            keys += [f"decoder.layers.{m}._extra_state/shard_{i}_{LAYERS}" for m in dense for i in range(LAYERS)]
        keys += [f"decoder.layers.{m}._extra_state/shard_{i}.{e}_{LAYERS}.{EXPERTS}"
                 for m in experts for i in range(LAYERS) for e in mine]
    else:
        for i in range(LAYERS):
            dense, experts = modules(i)
            if rank == 0:
                keys += [f"decoder.layers.{i}.{m}._extra_state/shard_0_1" for m in dense]
            keys += [f"decoder.layers.{i}.{m}._extra_state/shard_{e}_{EXPERTS}" for m in experts for e in mine]
    return keys


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


def rank_state_dict(model, tensors, rank):
    """The flat DCP state dict of one rank (keys = Megatron's sharded keys)."""
    layout = megatron_layout(model)
    sd = {}
    for key in layout:  # model weights, bf16
        chunks = [(o, t.to(torch.bfloat16)) for o, t in rank_chunks(layout, key, tensors[key], rank)]
        if chunks:
            sd[key] = LocalChunks(tensors[key].shape, chunks)
    for key in extra_state_keys(model, rank):
        sd[key] = serialized([torch.empty(0, dtype=torch.uint8)])
    for state in OPTIMIZER_STATES + ["fp32_param"]:
        for key in layout:
            w = tensors[key]
            value = {"fp32_param": w, "exp_avg": STATE_SCALE * w, "exp_avg_sq": (STATE_SCALE * w) ** 2}[state]
            chunks = rank_chunks(layout, key, value.float(), rank)
            if chunks:
                sd[f"optimizer.state.{state}.{key}"] = LocalChunks(w.shape, chunks)
    sd[f"rng_state/shard_0.{rank}_1.{TP}"] = serialized([[rng_state_stand_in(rank)]])
    return sd


def save_rank(rank, world, store, tensors_path, iter_dir, moe):
    torch.set_num_threads(1)
    set_tensor_parallel(world)  # (a forked process has it already; kept for any start method)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tensors = torch.load(tensors_path, weights_only=True)
        sd = rank_state_dict(Model(moe), tensors, rank)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(iter_dir, thread_count=1),
                 planner=MCoreLikeSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- common.pt


def make_args(model):
    args = argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, group_query_attention=True, kv_channels=HEAD_DIM,
        padded_vocab_size=VOCAB, vocab_size=VOCAB, make_vocab_size_divisible_by=VOCAB // TP,
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
    if model.moe is not None:
        vars(args).update(
            num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
            moe_grouped_gemm=model.grouped, moe_layer_freq=1 if model.stacked else [int(m) for m in model.moe_layers],
            expert_model_parallel_size=EP, expert_tensor_parallel_size=1, sequence_parallel=True,
            qk_layernorm=model.qk_norm, moe_router_pre_softmax=model.pre_softmax,
            moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
            moe_router_enable_expert_bias=False, moe_token_dispatcher_type="alltoall",
            moe_expert_capacity_factor=None,
            moe_shared_expert_intermediate_size=SHARED_FFN if model.shared else None,
            moe_shared_expert_gate=model.shared)
    return args


def parameter_names(model):
    """The parameters as --dump-param-to-param-group-map names them: global layer numbers, global
    expert indices, the model's expert names (TEGroupedMLP's or SequentialMLP's)."""
    yield "embedding.word_embeddings.weight"
    for i in range(LAYERS):
        for name, _, _, expert, _ in layer_params(model, i):
            if not expert:
                yield f"decoder.layers.{i}.{name}"
                continue
            linear, param = name[len("mlp.experts.experts."):].split(".")
            for e in range(EXPERTS):
                yield (f"decoder.layers.{i}.mlp.experts.{linear}.{param}{e}" if model.grouped
                       else f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{linear}.{param}")
    yield "decoder.final_layernorm.weight"
    yield "output_layer.weight"


def make_param_groups(model, with_params):
    """The dense optimizer's groups (0: weight decay, 1: wd_mult 0) and, with experts, the expert
    optimizer's group 2."""
    groups = []
    ids = (0, 1) if model.moe is None else (0, 1, 2)
    for gid in ids:
        wd, wd_mult = (0.0, 0.0) if gid == 1 else (WEIGHT_DECAY, 1.0)
        group = {
            "lr": LR, "bias_correction": True, "betas": BETAS, "eps": ADAM_EPS, "weight_decay": wd,
            "amsgrad": False, "adam_w_mode": True, "capturable": False, "master_weights": False,
            "is_expert_parallel": gid == 2, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": LR, "min_lr": MIN_LR, "step": ITERATION,
        }
        if with_params:  # torch optimizer state_dict numbering: consecutive, group by group
            sizes = [sum(1 for n in parameter_names(model) if group_of(n) == g) for g in ids]
            group["params"] = list(range(sum(sizes[:gid]), sum(sizes[:gid + 1])))
        groups.append(group)
    return groups


def make_common(model, megatron_nesting):
    if not megatron_nesting:
        optimizer = {"param_groups": make_param_groups(model, with_params=True)}
    elif model.moe is None:
        optimizer = {"optimizer": {"param_groups": make_param_groups(model, with_params=False)}}
    else:  # ChainedOptimizer of the dense and the expert optimizer
        groups = make_param_groups(model, with_params=False)
        optimizer = {0: {"optimizer": {"param_groups": groups[:2]}}, 1: {"optimizer": {"param_groups": groups[2:]}}}
    return {
        "args": make_args(model),
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


def write_torch_dist(out, model, tensors, megatron_nesting):
    import torch.multiprocessing as mp

    root = os.path.join(out, "torch_dist")
    iter_dir = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(iter_dir)
    with tempfile.TemporaryDirectory(prefix="mkckpt-") as tmp:
        tensors_path = os.path.join(tmp, "tensors.pt")
        torch.save(tensors, tensors_path)
        # Forked, not spawned: a spawned rank imports torch afresh (~2.5 s each on 2 cores, most of
        # the fixture's time at TP 4). The parent holds no process group and runs torch on one thread.
        mp.start_processes(save_rank, args=(TP, os.path.join(tmp, "store"), tensors_path, iter_dir, model.moe),
                           nprocs=TP, join=True, start_method="fork")
    torch.save(make_common(model, megatron_nesting), os.path.join(iter_dir, "common.pt"))
    with open(os.path.join(iter_dir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    return iter_dir


def write_param_map(out, model):
    path = os.path.join(out, "param_to_param_group_map")
    mapping = {f"module.module.{n}": group_of(n) for n in parameter_names(model)}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(mapping, storage_writer=dcp.FileSystemWriter(path, thread_count=1))
    return path, mapping


def write_reference_logits(out):
    """transformers' logits of the saved model on REFERENCE_IDS, for the test to compare mfsdp's with."""
    import transformers
    from safetensors.torch import save_file

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(out, "hf"), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf_model(REFERENCE_IDS).logits.float().contiguous()
    path = os.path.join(out, "reference_logits.safetensors")
    save_file({"input_ids": REFERENCE_IDS.contiguous(), "logits": logits}, path)
    return path


# ---------------------------------------------------------------- self check


def load_dcp(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="mkckpt-check-") as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
        return torch.load(os.path.join(tmp, "all.pt"), weights_only=False)


def megatron_forward(model, t, ids):
    """GPTModel forward in fp32 from Megatron tensors, written from Megatron's code
    (attention.py get_query_key_value_tensors with q/k_layernorm before RoPE, mlp.py glu, RMSNorm,
    rotate-half RoPE; moe_utils.py topk_softmax_with_capacity, shared_experts.py)."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    def get(i, rest):
        return t[f"decoder.layers.{rest}"][i] if model.stacked else t[f"decoder.layers.{i}.{rest}"]

    def glu_mlp(x, fc1, fc2):
        glu, lin = torch.chunk(x @ fc1.T, 2, -1)
        return (torch.nn.functional.silu(glu) * lin) @ fc2.T

    def moe(x, i):
        flat = x.reshape(-1, HIDDEN)
        logits = flat @ get(i, "mlp.router.weight").T
        if model.pre_softmax:
            probs, top = torch.topk(torch.softmax(logits, -1), TOPK)
        else:
            scores, top = torch.topk(logits, TOPK)
            probs = torch.softmax(scores, -1)
        fc1, fc2 = get(i, "mlp.experts.experts.linear_fc1.weight"), get(i, "mlp.experts.experts.linear_fc2.weight")
        out = torch.zeros_like(flat)
        for e in range(EXPERTS):
            rows, slot = (top == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, probs[rows, slot, None] * glu_mlp(flat[rows], fc1[e], fc2[e]))
        if model.shared:
            gate = torch.sigmoid(flat @ get(i, "mlp.shared_experts.gate_weight").T)
            out = out + gate * glu_mlp(flat, get(i, "mlp.shared_experts.linear_fc1.weight"),
                                       get(i, "mlp.shared_experts.linear_fc2.weight"))
        return out.view_as(x)

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
        x = rms(h, get(i, "self_attention.linear_qkv.layer_norm_weight"))
        mixed = x @ get(i, "self_attention.linear_qkv.weight").T
        mixed = mixed.view(*mixed.shape[:-1], ng, (per + 2) * HEAD_DIM)
        q, k, v = torch.split(mixed, [per * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
        q = q.reshape(*q.shape[:2], HEADS, HEAD_DIM)  # k, v: [b, s, ng, d]
        if model.qk_norm:
            q = rms(q, get(i, "self_attention.q_layernorm.weight"))
            k = rms(k, get(i, "self_attention.k_layernorm.weight"))
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(per, dim=2)
        v = v.repeat_interleave(per, dim=2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM ** 0.5 + mask
        ctx = torch.einsum("bhqk,bkhd->bqhd", att.softmax(-1), v).reshape(*h.shape[:2], HEADS * HEAD_DIM)
        h = h + ctx @ get(i, "self_attention.linear_proj.weight").T
        if model.moe_layers[i]:
            h = h + moe(rms(h, get(i, "pre_mlp_layernorm.weight")), i)
        else:
            x = rms(h, get(i, "mlp.linear_fc1.layer_norm_weight"))
            h = h + glu_mlp(x, get(i, "mlp.linear_fc1.weight"), get(i, "mlp.linear_fc2.weight"))
    return rms(h, t["decoder.final_layernorm.weight"]) @ t["output_layer.weight"].T


def self_check(out, model):
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
    expect(sorted(os.listdir(iter_dir)) == sorted([".metadata", "common.pt", "metadata.json"] +
                                                  [f"__{r}_0.distcp" for r in range(TP)]),
           f"iter dir files {sorted(os.listdir(iter_dir))}")
    with open(os.path.join(out, "torch_dist", "latest_checkpointed_iteration.txt")) as f:
        expect(f.read() == "3", "tracker file")

    # .metadata: keys, global shapes, dtypes, chunks cover each tensor once.
    md = FileSystemReader(iter_dir).read_metadata()
    expect(md.planner_data is None, "planner_data should be None (flatten_state_dict=False)")
    layout = megatron_layout(model)
    want = megatron_from_hf(hf, model)
    expected_keys = set()
    for key, w in want.items():
        for prefix, dtype in [("", torch.bfloat16)] + [(f"optimizer.state.{s}.", torch.float32)
                                                      for s in OPTIMIZER_STATES + ["fp32_param"]]:
            k = prefix + key
            expected_keys.add(k)
            m = md.state_dict_metadata.get(k)
            if not isinstance(m, TensorStorageMetadata):
                problems.append(f"{k}: missing or not a tensor")
                continue
            expect(m.size == w.shape, f"{k}: size {list(m.size)} != {list(w.shape)}")
            expect(m.properties.dtype == dtype, f"{k}: dtype {m.properties.dtype}")
            volume = sum(torch.Size(c.sizes).numel() for c in m.chunks)
            distinct = len({tuple(c.offsets) for c in m.chunks}) == len(m.chunks)
            expect(volume == w.numel() and distinct, f"{k}: chunks cover {volume} of {w.numel()} elements")

    def chunks_of(key):
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks)

    def file_of(key, offsets):
        return md.storage_data[MetadataIndex(key, torch.Size(offsets))].relative_path

    if model.moe is None:
        expect(len(md.state_dict_metadata) == 44 + TP, f"{len(md.state_dict_metadata)} keys")  # rng_state: 1 per rank
        chunk_count = {"tp": TP, "replicated": 1, "swiglu": 2 * TP}
        for key, (kind, _, lead, _) in layout.items():
            n = chunk_count[kind] * (LAYERS if lead else 1)
            expect(len(md.state_dict_metadata[key].chunks) == n, f"{key}: expected {n} chunks")
        expect(chunks_of("decoder.layers.mlp.linear_fc1.weight") ==
               sorted(((i, o, 0), (1, FFN // TP, HIDDEN)) for i in range(LAYERS) for o in range(0, 2 * FFN, FFN // TP)),
               "fc1 chunks are not the swiglu factory's")
        qkv_rows, proj_cols = (HEADS + 2 * KV_HEADS) * HEAD_DIM // TP, HEADS * HEAD_DIM // TP
        expect(chunks_of("decoder.layers.self_attention.linear_qkv.weight") ==
               sorted(((i, r * qkv_rows, 0), (1, qkv_rows, HIDDEN)) for i in range(LAYERS) for r in range(TP)),
               "qkv chunks")
        expect([o for o, _ in chunks_of("decoder.layers.self_attention.linear_proj.weight")] ==
               sorted((i, 0, proj_cols * r) for i in range(LAYERS) for r in range(TP)), "linear_proj chunks")
        # Each TP rank's chunks in its own file: [gate_r; up_r] of fc1, its vocab rows.
        for r in range(TP):
            for key, offsets in (("decoder.layers.mlp.linear_fc1.weight", (1, r * FFN // TP, 0)),
                                 ("decoder.layers.mlp.linear_fc1.weight", (1, FFN + r * FFN // TP, 0)),
                                 ("optimizer.state.exp_avg.output_layer.weight", (r * VOCAB // TP, 0)),
                                 ("decoder.layers.mlp.linear_fc2.weight", (0, 0, r * FFN // TP))):
                expect(file_of(key, offsets) == f"__{r}_0.distcp", f"{key} {offsets}: not in TP rank {r}'s file")
        expect(file_of("decoder.final_layernorm.weight", (0,)) == "__0_0.distcp", "final_layernorm: not rank 0's")
    else:
        # Each expert's two fc1 halves and its fc2, in its owner's file (EP rank e // 2).
        fc1 = model.layer_key(0, "mlp.experts.experts.linear_fc1.weight")
        fc2 = model.layer_key(0, "mlp.experts.experts.linear_fc2.weight")
        layers = [(i,) for i in range(LAYERS)] if model.stacked else [()]
        lead = (1,) if model.stacked else ()
        expect(chunks_of(fc1) == sorted((li + (e, half, 0), lead + (1, MOE_FFN, HIDDEN)) for li in layers
                                        for e in range(EXPERTS) for half in (0, MOE_FFN)), f"{fc1} chunks")
        expect(chunks_of(fc2) == sorted((li + (e, 0, 0), lead + (1, HIDDEN, MOE_FFN)) for li in layers
                                        for e in range(EXPERTS)), f"{fc2} chunks")
        for li in layers:
            for e in range(EXPERTS):
                for key, offsets in ((fc1, li + (e, MOE_FFN, 0)), (fc2, li + (e, 0, 0)),
                                     ("optimizer.state.exp_avg." + fc1, li + (e, 0, 0))):
                    expect(file_of(key, offsets) == f"__{e // 2}_0.distcp", f"{key} expert {e}: not in EP rank {e // 2}'s file")
        router = model.layer_key(0, "mlp.router.weight")
        expect(len(chunks_of(router)) == len(layers) and file_of(router, layers[0] + (0, 0)) == "__0_0.distcp",
               "router chunks")
        if model.shared:
            expect(chunks_of("decoder.layers.0.mlp.shared_experts.linear_fc1.weight") ==
                   sorted(((o, 0), (SHARED_FFN // 2, HIDDEN)) for o in range(0, 2 * SHARED_FFN, SHARED_FFN // 2)),
                   "shared expert fc1 chunks")
    bytes_keys = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    expect(bytes_keys == {k for r in range(TP) for k in extra_state_keys(model, r)} |
           {f"rng_state/shard_0.{r}_1.{TP}" for r in range(TP)}, f"BYTES keys {sorted(bytes_keys)}")
    expect(set(md.state_dict_metadata) == expected_keys | bytes_keys, "unexpected keys")

    # Values: every tensor is the mapped HF weights.
    sd = load_dcp(iter_dir)
    checks = [("", lambda w: w.to(torch.bfloat16)),
              ("optimizer.state.fp32_param.", lambda w: w),
              ("optimizer.state.exp_avg.", lambda w: STATE_SCALE * w),
              ("optimizer.state.exp_avg_sq.", lambda w: (STATE_SCALE * w) ** 2)]
    for prefix, expected_fn in checks:
        for key, w in want.items():
            expect(torch.equal(sd[prefix + key], expected_fn(w)), f"{prefix}{key}: not the mapped HF weights")
    if model.moe is None:
        # The inverse (unstack, de-interleave, split fc1) gives back every HF tensor.
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

        got = to_hf(lambda k: sd["optimizer.state.fp32_param." + k])
        expect(set(got) == set(hf) and all(torch.equal(got[n], w) for n, w in hf.items()),
               "fp32_param: the HF tensors do not come back")
        # Global qkv rows 32..63 (TP rank 1's chunk with TP 2) are exactly KV group 1 (q heads 2,3,
        # k head 1, v head 1), whatever the TP of the save.
        l0 = hf["model.layers.0.self_attn.q_proj.weight"]
        expect(torch.equal(sd["optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight"][0, 32:48],
                           l0[16:32]), "qkv: global rows 32..47 are not q heads 2,3")
    else:
        # Expert 3 of layer 0 is HF's experts.3 (the expert axis is the global expert index).
        g = sd["optimizer.state.fp32_param." + model.layer_key(0, "mlp.experts.experts.linear_fc1.weight")]
        g = g[0, 3] if model.stacked else g[3]
        expect(torch.equal(g[:MOE_FFN], hf["model.layers.0.mlp.experts.3.gate_proj.weight"]), "expert 3 is not HF's")
    for k, v in sd.items():
        if "_extra_state" in k:
            expect(isinstance(v, list) and v[0].numel() == 0 and v[0].dtype == torch.uint8, f"{k}: {v!r}")
        if k.startswith("rng_state"):
            expect(isinstance(v, list) and isinstance(v[0], list) and "torch_rng_state" in v[0][0], f"{k}")

    # Semantics: Megatron's forward on the checkpoint == transformers' logits (the file's too).
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf_model(REFERENCE_IDS).logits
    saved = load_file(os.path.join(out, "reference_logits.safetensors"))
    expect(torch.equal(saved["logits"], ref) and torch.equal(saved["input_ids"], REFERENCE_IDS), "reference_logits")
    fp32 = "optimizer.state.fp32_param."
    mt = {k[len(fp32):]: v for k, v in sd.items() if k.startswith(fp32)}
    diff = (megatron_forward(model, mt, REFERENCE_IDS) - ref).abs().max().item()
    expect(diff < 1e-4, f"Megatron-style forward differs from transformers by {diff}")

    # common.pt
    common = torch.load(os.path.join(iter_dir, "common.pt"), weights_only=False)
    a = common["args"]
    expect(isinstance(a, argparse.Namespace) and a.num_query_groups == KV_HEADS and a.params_dtype == torch.bfloat16
           and a.num_experts == (None if model.moe is None else EXPERTS), "common.pt args")
    expect(common["iteration"] == ITERATION and common["checkpoint_version"] == 3.0, "common.pt iteration/version")
    o = common["optimizer"]
    if "param_groups" in o:
        groups = o["param_groups"]
    elif "optimizer" in o:
        groups = o["optimizer"]["param_groups"]
    else:  # ChainedOptimizer
        groups = [g for k in sorted(o) for g in o[k]["optimizer"]["param_groups"]]
    wds = [WEIGHT_DECAY, 0.0] + ([] if model.moe is None else [WEIGHT_DECAY])
    expect([g["weight_decay"] for g in groups] == wds and all(g["step"] == ITERATION for g in groups),
           "common.pt param groups")

    # param_to_param_group_map
    pmap = load_dcp(os.path.join(out, "param_to_param_group_map"))
    names = list(parameter_names(model))
    expect(len(pmap) == len(names) and pmap["module.module.decoder.layers.1.self_attention.linear_qkv.weight"] == 0
           and pmap["module.module.decoder.final_layernorm.weight"] == 1, f"param map {pmap}")
    if model.moe is None:
        expect(len(pmap) == 3 + 6 * LAYERS and pmap["module.module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == 1,
               "dense param map")
    else:
        expert = ("module.module.decoder.layers.0.mlp.experts.linear_fc2.weight3" if model.grouped
                  else "module.module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight")
        expect(pmap.get(expert) == 2 and pmap["module.module.decoder.layers.0.pre_mlp_layernorm.weight"] == 1
               and pmap["module.module.decoder.layers.0.mlp.router.weight"] == 0, f"MoE param map {pmap}")

    if problems:
        raise SystemExit("self-check FAILED:\n  " + "\n  ".join(problems))
    print(f"self-check: OK ({len(md.state_dict_metadata)} DCP keys, the mapped HF tensors exactly, "
          f"Megatron-style forward vs transformers max |diff| {diff:.2e})")


# ---------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--self-check", action="store_true", help="read everything back and compare")
    parser.add_argument("--megatron-common-optimizer", action="store_true",
                        help='common.pt optimizer as Megatron-Core nests it, without "params"')
    parser.add_argument("--moe", choices=["grouped", "sequential"],
                        help="a mixture-of-experts GPT (see the docstring) instead of the dense Llama")
    parser.add_argument("--tensor-parallel", type=int, choices=TP_CHOICES, default=TP,
                        help="the TP size of the Megatron save (one .distcp file per TP rank; dense model only)")
    opts = parser.parse_args()
    if opts.moe and opts.tensor_parallel != 2:
        parser.error("--moe writes TP 2 / EP 2 only (its 2 ranks are the expert-parallel ranks)")
    set_tensor_parallel(opts.tensor_parallel)
    start = time.time()
    out = os.path.abspath(opts.out_dir)
    for sub in ("hf", "torch_dist", "param_to_param_group_map", "reference_logits.safetensors"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    model = Model(opts.moe)

    from safetensors.torch import load_file

    hf_model = build_hf_model(model)
    hf_model.save_pretrained(os.path.join(out, "hf"))
    hf = load_file(os.path.join(out, "hf", "model.safetensors"))  # transformers' names (one per expert)
    print(f"hf: {out}/hf {type(hf_model).__name__} fp32, {len(hf)} tensors, "
          f"{sum(v.numel() for v in hf.values())} params (model.safetensors, config.json)")
    logits = write_reference_logits(out)
    print(f"reference logits: {logits}")

    tensors = megatron_from_hf(hf, model)
    iter_dir = write_torch_dist(out, model, tensors, opts.megatron_common_optimizer)
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(iter_dir).read_metadata()
    n_chunks = sum(len(getattr(v, "chunks", [])) for v in md.state_dict_metadata.values())
    parallel = f"TP={TP}" if model.moe is None else f"TP={TP}, EP={EP} (expert TP 1), {opts.moe} experts"
    print(f"torch_dist: {iter_dir} iteration {ITERATION}, {parallel} ({TP} Gloo ranks), "
          f"{len(md.state_dict_metadata)} DCP keys "
          f"({n_chunks} tensor chunks), bf16 weights + fp32 fp32_param/exp_avg/exp_avg_sq, common.pt, metadata.json")

    path, mapping = write_param_map(out, model)
    counts = [sum(1 for v in mapping.values() if v == g) for g in range(3)]
    print(f"param_to_param_group_map: {path} {len(mapping)} params, {counts[0]} in group 0 (weight decay), "
          f"{counts[1]} in group 1 (norms)" + (f", {counts[2]} in group 2 (experts)" if model.moe else ""))

    if opts.self_check:
        self_check(out, model)
    print(f"done in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
