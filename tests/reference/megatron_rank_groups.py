"""Writes tests/reference/megatron_rank_groups.json: Megatron-Core's process groups for 14 layouts,
the known values tests/unit/parallel_dims_test.cpp checks ParallelMesh against.

Run with megatron-core installed (not a test dependency; 0.16.1 wrote the file):
    python tests/reference/megatron_rank_groups.py [path/to/megatron/core/parallel_state.py]
It takes RankGenerator and generate_masked_orthogonal_rank_groups out of parallel_state.py (the
module itself imports torch.distributed) and builds the groups as initialize_model_parallel
does: the dense generator (ep 1) and the expert one (cp 1, tp = expert tensor-parallel size,
dp = world / (etp x ep x pp)), order "tp-cp-ep-dp-pp"; the partial distributed optimizer's
groups (--num-distributed-optimizer-instances) as consecutive runs of the data-parallel groups.
"""
import ast
import json
import os
import sys


def load_rank_generator(path):
    tree = ast.parse(open(path).read())
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
            and n.name in ("generate_masked_orthogonal_rank_groups", "RankGenerator")]
    ns = {}
    exec("from typing import List\n", ns)
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), ns)
    return ns["RankGenerator"]


def groups(RankGenerator, tp, cp, ep, etp, pp, world, instances):
    dp = world // (tp * cp * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    edp = world // (etp * ep * pp)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out = {"tp": dense.get_ranks("tp"), "cp": dense.get_ranks("cp"), "dp": dense.get_ranks("dp"),
           "dp_cp": dense.get_ranks("dp-cp"), "pp": dense.get_ranks("pp"), "tp_cp": dense.get_ranks("tp-cp"),
           "ep": expert.get_ranks("ep"), "etp": expert.get_ranks("tp"), "edp": expert.get_ranks("dp"),
           "etp_ep": expert.get_ranks("tp-ep")}
    intra = dp * cp // instances  # _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP: consecutive runs
    out["dp_shard_cp"] = [g[i * intra:(i + 1) * intra] for g in dense.get_ranks("dp-cp") for i in range(instances)]
    out["dp_replicate"] = [g[j::intra] for g in dense.get_ranks("dp-cp") for j in range(intra)]
    expert_intra = edp // instances  # create_hierarchical_groups' first level
    out["edp_shard"] = [g[i * expert_intra:(i + 1) * expert_intra] for g in expert.get_ranks("dp")
                        for i in range(instances)]
    return out


LAYOUTS = [  # tp, cp, ep, etp, pp, world, instances
    (1, 1, 1, 1, 1, 1, 1), (2, 1, 1, 2, 1, 4, 1), (1, 2, 1, 1, 1, 4, 1), (2, 2, 1, 2, 1, 8, 1),
    (1, 1, 2, 1, 1, 4, 1), (1, 1, 4, 1, 1, 8, 2), (2, 1, 2, 1, 1, 4, 1), (2, 1, 2, 2, 1, 8, 1),
    (1, 2, 2, 1, 1, 4, 1), (2, 2, 2, 1, 1, 16, 2), (1, 1, 2, 1, 2, 8, 1), (2, 2, 4, 2, 2, 32, 2),
    (4, 1, 8, 1, 1, 32, 1), (1, 1, 1, 1, 1, 8, 4),
]

if __name__ == "__main__":
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        import importlib.util
        path = importlib.util.find_spec("megatron.core").submodule_search_locations[0] + "/parallel_state.py"
    RankGenerator = load_rank_generator(path)
    result = []
    for tp, cp, ep, etp, pp, world, instances in LAYOUTS:
        result.append({"tp": tp, "cp": cp, "ep": ep, "etp": etp, "pp": pp, "world": world, "instances": instances,
                       "groups": groups(RankGenerator, tp, cp, ep, etp, pp, world, instances)})
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_rank_groups.json")
    with open(out, "w") as f:
        json.dump(result, f)
