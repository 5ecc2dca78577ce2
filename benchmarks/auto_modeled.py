"""Load-independent figures for --speculative auto on a shared machine.

Per step: the drafts fed (their verify cost from the measured table, engine.step_cost) and
the hybrid's own CPU time (time.thread_time, scaled by a plain step's wall time); the modeled
speedup is tokens / the sum of step costs. Usage:
    python benchmarks/auto_modeled.py ARTIFACT chat|random
"""

import json
import sys
import time

import numpy as np

import specport
from specport.bench.prompt_sets import chat_prompt_ids
from specport.runtime.engine.step_cost import verify_costs
from specport.runtime.sampler import SamplingConfig
from specport.runtime.speculative.hybrid import make_hybrid_proposer
from specport.runtime.speculative.loop import SpeculativeGenerator

m = specport.load(sys.argv[1], threads=2)
costs = verify_costs(m, 8)
which = sys.argv[2]
if which == "chat":
    prompts = chat_prompt_ids(m, "chat")
else:
    prompts = [np.random.default_rng(s).integers(100, 49152, 64).tolist() for s in range(1, 5)]
plain_s = []
for ids in prompts[:2]:
    out = m.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True)
    plain_s.append(out.metrics["decode_wall_s"] / out.metrics["decode_steps"])
step_s = min(plain_s)
p = make_hybrid_proposer(m, 8)
ks, cpu = [], [0.0]
inner = p.propose


def propose(ctx, k):
    t = time.thread_time()
    d = inner(ctx, k)
    cpu[0] += time.thread_time() - t
    ks.append(int(d.lengths[0]))
    return d


p.propose = propose
gen = SpeculativeGenerator(m.session, m.manifest, p, 8)
tot_tokens = tot_cost = 0.0
equal = True
for ids in prompts:
    plain = m.generate(prompt_ids=ids, max_new_tokens=128, ignore_eos=True)
    ks.clear()
    cpu[0] = 0.0
    out = gen.generate(ids, 128, SamplingConfig())
    equal &= out.tokens == list(plain.tokens)
    cost = sum(costs[k] for k in ks) + cpu[0] / step_s
    tot_tokens += len(out.tokens)
    tot_cost += cost
    print(
        f"{len(out.tokens)} tokens {len(ks)} steps, drafted {sum(ks)}, propose cpu {1e3 * cpu[0] / len(ks):.2f} ms/step, modeled {len(out.tokens) / cost:.2f}x",
        flush=True,
    )
print(
    json.dumps(
        {
            "set": which,
            "plain_step_ms": round(1e3 * step_s, 1),
            "modeled_speedup": round(tot_tokens / tot_cost, 3),
            "equal": equal,
            "report": p.report(),
            "costs": [round(c, 3) for c in costs],
        }
    )
)
