"""Make a tiny randomly initialised GPT-2 (2 layers, 4 heads, 64 wide) with SmolLM2's tokenizer, saved locally."""
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, AutoTokenizer
src, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(src)
torch.manual_seed(0)
cfg = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=len(tok),
                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
m = GPT2LMHeadModel(cfg).eval()
m.save_pretrained(out); tok.save_pretrained(out)
# transformer-lens 2.x (auto-circuit's venv) reads hf_config.n_ctx, which transformers 5 no longer writes
import json, pathlib
cp = pathlib.Path(out) / "config.json"; c = json.loads(cp.read_text()); c["n_ctx"] = cfg.n_positions
cp.write_text(json.dumps(c, indent=2) + "\n")
print(out, sum(p.numel() for p in m.parameters()))
