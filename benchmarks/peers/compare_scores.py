"""Compare two {edge: score} JSON files (eap_peer.py or headlab output): edge sets, max abs/rel diff, rank corr."""
import json, sys, math
a, b = (json.load(open(p)) for p in sys.argv[1:3])
a = {k: v for k, v in a.items() if not k.startswith("_")}; b = {k: v for k, v in b.items() if not k.startswith("_")}
ka, kb = set(a), set(b)
print(f"edges: {len(ka)} vs {len(kb)}; only in first {len(ka-kb)}, only in second {len(kb-ka)}")
for k in sorted(ka ^ kb)[:5]: print("  unmatched:", k)
common = sorted(ka & kb)
scale = max(abs(a[k]) for k in common) or 1.0
diff = max(abs(a[k] - b[k]) for k in common)
worst = max(common, key=lambda k: abs(a[k] - b[k]))
print(f"max|score| {scale:.3e}; max|diff| {diff:.3e} ({diff/scale:.2e} of max) at {worst}: {a[worst]:.6e} vs {b[worst]:.6e}")
def ranks(x):
    o = sorted(range(len(x)), key=lambda i: x[i]); r = [0]*len(x)
    for j, i in enumerate(o): r[i] = j
    return r
ra, rb = ranks([a[k] for k in common]), ranks([b[k] for k in common])
n = len(common); ma = sum(ra)/n
cov = sum((x-ma)*(y-ma) for x, y in zip(ra, rb)); va = sum((x-ma)**2 for x in ra)
print(f"Spearman {cov/va:.6f}")
top = lambda d: set(sorted(common, key=lambda k: -abs(d[k]))[:min(100, n)])
print(f"top-{min(100,n)} |score| overlap: {len(top(a) & top(b))}")
