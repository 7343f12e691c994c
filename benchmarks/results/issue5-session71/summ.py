"""Per-rank summary of issue5 benchmark JSONs (session 71)."""
import json, sys, gzip
def load(p):
    op = gzip.open if p.endswith('.gz') else open
    with op(p, 'rt') as f: return json.load(f)
for p in sys.argv[1:]:
    d = load(p)
    print('==', p)
    for r in d['ranks']:
        a, o = r.get('alternation') or {}, r.get('offload') or {}
        on = a.get('on_steps') or []
        sp = a.get('step_peaks') or []
        onp = [x for x, b in zip(sp, on) if b]; offp = [x for x, b in zip(sp, on) if not b]
        G = 2**30
        print(f" rank {r['rank']}: overhead {a.get('paired_overhead_pct')} ci {a.get('paired_overhead_ci95_pct')} dpeak {a.get('delta_peak_bytes',0)/2**20:.0f} MiB"
              f" peak on max {max(onp)/G if onp else float('nan'):.3f} off max {max(offp)/G if offp else float('nan'):.3f} GiB")
        print(f"   pinned/step {o.get('host_buffer_allocations_per_step')}  on-demand/step {o.get('reloaded_on_demand_per_step')}  by_key {o.get('on_demand_by_key')}")
        print(f"   stall {r.get('stall_ms')} d2h {r.get('d2h_GBps')} h2d {r.get('h2d_GBps')}")
        plan = (r.get('auto_record') or {}).get('plan')
        print(f"   plan {json.dumps(plan)[:600]}  need {(r.get('auto_record') or {}).get('need_bytes')}")
        print(f"   loss_hex[:3] {r['loss_hex'][:3]} n={len(r['loss_hex'])}")
