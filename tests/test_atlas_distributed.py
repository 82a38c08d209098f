"""The atlas under 2 gloo ranks (127.0.0.1): the needle trials and the checks' configurations are split over the
ranks and gathered back; the result equals one process's, verdicts and per-example effects included."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from headlab.interpret.atlas import Atlas, atlas

pytestmark = pytest.mark.distributed

WORKER = textwrap.dedent('''
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[5])
    from test_atlas_distributed import setup
    from headlab.interpret.atlas import atlas
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    model, kw = setup()
    a = atlas(model, **kw)
    if rank == 0:
        open(out, "w").write(json.dumps(a.to_json()))
    dist.destroy_process_group()
''')


def setup():
    import torch
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True))
    kw = dict(texts=[[(7 * i) % 37 + 1 for i in range(150)]], k=2, n_draws=10, half=7, n_repeated=3, max_tokens=24,
              n_texts=3, needle_trials=3, haystack_tokens=30, n_boot=200)
    return m.eval(), kw


def test_two_ranks_equal_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "atlas.json"
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(port), str(out), here], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), [x[-3000:] for x in logs]
    two = Atlas.from_json(json.loads(out.read_text()))
    model, kw = setup()
    one = atlas(model, **kw)
    assert one.kinds == two.kinds
    for kind in one.kinds:
        assert torch.allclose(two.scores[kind], one.scores[kind].double(), atol=1e-6, equal_nan=True), kind
    for kind, v in one.verdicts.items():
        assert two.verdicts[kind]["verdict"] == v["verdict"]
        assert two.verdicts[kind]["effects"]["targeted"] == pytest.approx(v["effects"]["targeted"], abs=1e-7)
        assert torch.allclose(torch.tensor(two.verdicts[kind]["effects"]["random"]),
                              torch.tensor(v["effects"]["random"]), atol=1e-7)
    assert two.settings["needle_runs"] == one.settings["needle_runs"]
