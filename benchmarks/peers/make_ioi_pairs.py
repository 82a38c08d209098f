"""IOI-like clean/corrupted pairs of equal length for a tokenizer: pairs.pt {clean, corrupted, answer, wrong}.

clean:     "When {A} and {B} went to the {place}, {B} gave a {obj} to"   answer " {A}", wrong " {B}"
corrupted: the same with the second {B} replaced by a third name {C} (ABC corruption, Wang et al. 2022).
Names are chosen among those that are one token with a leading space, so every prompt has the same length."""
import argparse, random, torch
from transformers import AutoTokenizer
p = argparse.ArgumentParser()
p.add_argument("--tokenizer", required=True); p.add_argument("--out", required=True)
p.add_argument("--n", type=int, default=4); p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
tok = AutoTokenizer.from_pretrained(a.tokenizer)
cands = ["Mary", "John", "Alice", "Bob", "Tom", "James", "Sarah", "David", "Emma", "Paul", "Anna", "Mark",
         "Kate", "Peter", "Laura", "Mike", "Lisa", "Jack", "Rose", "Sam"]
names = [n for n in cands if len(tok.encode(" " + n, add_special_tokens=False)) == 1]
places = [w for w in ["store", "park", "school", "office", "market", "beach"] if len(tok.encode(" " + w, add_special_tokens=False)) == 1]
objs = [w for w in ["drink", "book", "ball", "gift", "letter", "pen"] if len(tok.encode(" " + w, add_special_tokens=False)) == 1]
rng = random.Random(a.seed)
def ids(s): return tok.encode(s, add_special_tokens=False)
clean, corr, ans, wrong = [], [], [], []
L = None
while len(clean) < a.n:
    A, B, C = rng.sample(names, 3); place, obj = rng.choice(places), rng.choice(objs)
    c = ids(f"When {A} and {B} went to the {place}, {B} gave a {obj} to")
    x = ids(f"When {A} and {B} went to the {place}, {C} gave a {obj} to")
    if len(c) != len(x) or (L is not None and len(c) != L):
        continue
    L = len(c)
    clean.append(c); corr.append(x); ans.append(ids(" " + A)[0]); wrong.append(ids(" " + B)[0])
out = {"clean": torch.tensor(clean), "corrupted": torch.tensor(corr), "answer": torch.tensor(ans), "wrong": torch.tensor(wrong)}
torch.save(out, a.out)
print(a.out, {k: tuple(v.shape) for k, v in out.items()}, "names:", len(names))
print(tok.decode(clean[0]), "|", tok.decode(corr[0]), "|", tok.decode([ans[0]]), tok.decode([wrong[0]]))
