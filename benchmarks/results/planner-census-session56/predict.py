"""The planner's no-offload peak for runs it was not fitted on, written down before they ran (session 56).

    python3 benchmarks/results/planner-census-session56/predict.py flags NAME   # pretrain_gpt.py's flags of a run
    python3 benchmarks/results/planner-census-session56/predict.py predict      # -> predictions.json (committed first)
    python3 benchmarks/results/planner-census-session56/predict.py compare DIR  # measured NAME.json against it

Each run's plan is built from its pretrain_gpt.py flags as tests/test_plan_validation.py builds the matrix's
(``plan_argv``): the planner as of this session's change (expert outputs under deterministic unpermute, cuBLAS
workspaces, unfused RoPE, the final norm, backward working set 1.25).
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


def predicted_bytes(name: str) -> int:
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
    from pretrain_args import parse_args
    from test_plan_validation import _plan, plan_argv

    args = vars(parse_args(RUNS[name].split()))
    args["offload_modules"] = []
    return _plan(tuple(plan_argv(args))).ranks[0].total_bytes("none")


def main(argv: list[str]) -> int:
    if argv[:1] == ["flags"]:
        print(RUNS[argv[1]])
    elif argv[:1] == ["predict"]:
        out = {name: predicted_bytes(name) for name in RUNS}
        (HERE / "predictions.json").write_text(json.dumps(out, indent=1) + "\n")
        for name, b in out.items():
            print(f"{name:<24}{b / MIB:>10.1f} MiB")
    elif argv[:1] == ["compare"]:
        predicted = json.loads((HERE / "predictions.json").read_text())
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
