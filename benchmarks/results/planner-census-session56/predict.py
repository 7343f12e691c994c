"""The planner's no-offload peak for runs it was not fitted on, written down before they ran (session 56).

    python3 benchmarks/results/planner-census-session56/predict.py flags NAME         # pretrain_gpt.py's flags
    python3 benchmarks/results/planner-census-session56/predict.py predict [2]        # -> predictions[2].json (done)
    python3 benchmarks/results/planner-census-session56/predict.py compare DIR [2]    # measured NAME.json against it

Batch 1 (``predictions.json``) was written with the planner of commit 1c425c8; batch 2 (``predictions2.json``)
after E4 of batch 1 missed by 4 % and the planner learnt what a core-attention checkpoint keeps; batch 4
(``predictions4.json``, dropout) after the planner learnt the dropout masks (batch 3 is predict_offload.py's).
Each batch's file was committed before its runs. Each run's plan is built from its pretrain_gpt.py flags as
tests/test_plan_validation.py builds the matrix's (``plan_argv``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
MIB = 2**20
COMMON = ("--seq-length 4096 --micro-batch-size 1 --bf16 --transformer-impl transformer_engine --num-microbatches 4 "
          "--train-iters 3 --warmup-steps 1 --peak-trace-census")
MOE_C = ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --num-experts 16 "
         "--moe-router-topk 4 --moe-ffn-hidden-size 1024")
# later flags win (argparse): each run changes the common ones it needs
RUNS = {
    # the census run whose JSON did not come back in the first call (its peak, 7441.7 MiB, was printed)
    "C-nondet": f"{MOE_C} {COMMON}",
    # GQA (never validated): 12 layers of hidden 3072, 24 heads in 8 groups
    "E1-gqa-det": f"--num-layers 12 --hidden-size 3072 --num-attention-heads 24 --num-query-groups 8 "
                  f"--ffn-hidden-size 8192 {COMMON} --deterministic",
    # another MoE: 8 experts top-2, moe ffn 2048, 6 layers, seq 2048 x micro-batch 2
    "E2-moe-mbs2-det": f"--num-layers 6 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
                       f"--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2048 {COMMON} "
                       f"--seq-length 2048 --micro-batch-size 2 --deterministic",
    "E3-moe-mbs2-nondet": f"--num-layers 6 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
                          f"--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2048 {COMMON} "
                          f"--seq-length 2048 --micro-batch-size 2",
    # selective recompute of core attention (megatron-core's default module), A's model cut to 8 layers
    "E4-dense-recompute-det": f"--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
                              f"{COMMON} --recompute-granularity selective --deterministic",
}
# batch 2: recompute, after the core-attention checkpoint's inputs were modelled (E4)
RUNS2 = {
    # GQA and core_attn recompute: the checkpoint's rotated q and k are T (q + kv), not 2 T q
    "E5-gqa-recompute-det": f"--num-layers 12 --hidden-size 3072 --num-attention-heads 24 --num-query-groups 8 "
                            f"--ffn-hidden-size 8192 {COMMON} --recompute-granularity selective --deterministic",
    # the dense MLP checkpointed: a layer keeps the MLP's input only
    "E6-dense-mlp-recompute-det": f"--num-layers 8 --hidden-size 2048 --num-attention-heads 16 "
                                  f"--ffn-hidden-size 8192 {COMMON} --recompute-granularity selective "
                                  f"--recompute-modules mlp --deterministic",
    # C's MoE model with the expert activation and the norms recomputed
    "E7-moe-act-norm-recompute-det": f"{MOE_C} {COMMON} --recompute-granularity selective "
                                     f"--recompute-modules moe_act layernorm --deterministic",
}
# batch 4: dropout (Megatron-LM's default 0.1), after the planner learnt its masks from megatron-core's source
A8 = "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192"
RUNS4 = {
    "E8-dense-dropout-det": f"{A8} {COMMON} --hidden-dropout 0.1 --deterministic",
    # TE's fused attention keeps its RNG state, not a mask: the same peak as E8 is the prediction
    "E9-dense-dropouts-det": f"{A8} {COMMON} --hidden-dropout 0.1 --attention-dropout 0.1 --deterministic",
}
BATCHES = {"": RUNS, "2": RUNS2, "4": RUNS4}
ALL_RUNS = {**RUNS, **RUNS2, **RUNS4}


def plan_inputs(run_flags: str, offload_modules: list[str]):
    """The plan of a pretrain_gpt.py run with these flags, as tests/test_plan_validation.py builds one, and its args."""
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
    from pretrain_args import parse_args
    from test_plan_validation import _plan, plan_argv

    args = vars(parse_args(run_flags.split()))
    args["offload_modules"] = offload_modules
    return _plan(tuple(plan_argv(args))), args


def predicted_bytes(name: str) -> int:
    return plan_inputs(ALL_RUNS[name], [])[0].ranks[0].total_bytes("none")


def main(argv: list[str]) -> int:
    if argv[:1] == ["flags"]:
        print(ALL_RUNS[argv[1]])
    elif argv[:1] == ["predict"]:
        batch = argv[1] if len(argv) > 1 else ""
        out = {name: predicted_bytes(name) for name in BATCHES[batch]}
        (HERE / f"predictions{batch}.json").write_text(json.dumps(out, indent=1) + "\n")
        for name, b in out.items():
            print(f"{name:<24}{b / MIB:>10.1f} MiB")
    elif argv[:1] == ["compare"]:
        predicted = json.loads((HERE / f"predictions{argv[2] if len(argv) > 2 else ''}.json").read_text())
        print(f"{'run':<24}{'predicted':>11}{'measured':>11}{'error':>9}   (MiB, the no-offload peak of step 1)")
        for name, b in predicted.items():
            path = Path(argv[1]) / f"{name}.json"
            if not path.exists():
                print(f"{name:<24}{b / MIB:>11.1f}{'-':>11}")
                continue
            measured = json.loads(path.read_text())["ranks"][0]["peak_bytes_step1"]
            print(f"{name:<24}{b / MIB:>11.1f}{measured / MIB:>11.1f}{(b - measured) / measured:>+9.2%}")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
