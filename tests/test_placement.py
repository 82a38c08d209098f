"""One placement: which rank holds which heads and runs which units, for every layout a run can have.

The arithmetic is checked without processes (one process, data parallel over 4 ranks, tensor parallel over 2 and 4,
a 2x2 (data, tensor) mesh); the sums over the ranks are checked once on 2 spawned gloo ranks. The request for
tensor parallelism (``headlab.load(..., tensor_parallel=...)``) is normalised and checked in one place.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from headlab.distributed.placement import Placement, TensorParallel, is_dtensor
from headlab.errors import ConfigError, InputError


def test_one_process_is_trivial():
    p = Placement(n_heads=4, n_kv_heads=2)
    assert (p.kind, p.alone, p.world, p.rank, p.tensor_size, p.tensor_rank) == ("single", True, 1, 0, 1, 0)
    assert (p.data_rank, p.data_size, p.unit_share()) == (0, 1, (0, 1))
    assert p.units(["a", "b", "c"]) == ["a", "b", "c"] and p.examples(3) == [0, 1, 2]
    assert list(p.heads()) == [0, 1, 2, 3] and list(p.kv_heads()) == [0, 1] and p.local_heads == 4
    t = torch.arange(6.0).view(1, 3, 2)
    assert p.sum_heads(t) is t and p.sum_group(t) is t and p.sum_over_data(t) is t
    assert p.gather(t, "z") is t and p.local(t, "z") is t and p.gather_sites({"blocks.0.attn.z": t}) == {
        "blocks.0.attn.z": t}
    got = p.sum_over_data([[1, 2], torch.tensor([3.0])])  # a list: float64 tensors, in order
    assert [x.dtype for x in got] == [torch.float64] * 2 and got[0].tolist() == [1.0, 2.0]
    assert Placement.here() == Placement() and Placement.of(None) == Placement()


@pytest.mark.parametrize("rank", range(4))
def test_data_parallel_over_4_ranks_splits_the_units_and_holds_every_head(rank):
    p = Placement(world=4, rank=rank, n_heads=8, n_kv_heads=2)
    assert (p.kind, p.data_rank, p.data_size, p.tensor_rank) == ("data", rank, 4, 0)
    assert p.examples(10) == list(range(rank, 10, 4))
    assert p.units([f"u{i}" for i in range(6)]) == [f"u{i}" for i in range(rank, 6, 4)]
    assert list(p.heads()) == list(range(8)) and not p.sharded


def test_the_units_of_every_rank_cover_the_work_once():
    for world, tensor in [(1, 1), (4, 1), (2, 2), (4, 2), (4, 4), (6, 3)]:
        shares = [Placement(world=world, rank=r, tensor_size=tensor).examples(11) for r in range(world)]
        for r in range(world):  # every rank of a tensor-parallel group runs the same units
            assert shares[r] == shares[r - r % tensor]
        firsts = [shares[r] for r in range(0, world, tensor)]
        assert sorted(i for s in firsts for i in s) == list(range(11)), (world, tensor)


@pytest.mark.parametrize("rank,heads,kv", [(0, [0, 1], [0]), (1, [2, 3], [1])])
def test_tensor_parallel_over_2_ranks_holds_half_the_heads_and_runs_every_unit(rank, heads, kv):
    p = Placement(world=2, rank=rank, tensor_size=2, n_heads=4, n_kv_heads=2, sharded=True)
    assert (p.kind, p.tensor_rank, p.data_rank, p.data_size, p.local_heads, p.local_kv_heads) == (
        "tensor", rank, 0, 1, 2, 1)
    assert list(p.heads()) == heads and list(p.kv_heads()) == kv and p.examples(5) == [0, 1, 2, 3, 4]
    assert list(p.heads_of("k")) == kv and list(p.heads_of("pattern")) == heads
    assert p.global_index(1) == heads[1] and p.owner(3) == (1, 1) and list(p.heads(0)) == [0, 1]
    t = torch.arange(4.0).view(1, 4, 1)  # a site in global head order: this rank's slice
    assert p.local(t, "z").flatten().tolist() == [float(h) for h in heads]
    assert p.local(t, "resid_pre") is t  # no head axis


def test_tensor_parallel_over_4_ranks():
    ps = [Placement(world=4, rank=r, tensor_size=4, n_heads=8, n_kv_heads=4, sharded=True) for r in range(4)]
    assert [list(p.heads()) for p in ps] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(p.kv_heads()) for p in ps] == [[0], [1], [2], [3]]
    assert {p.unit_share() for p in ps} == {(0, 1)}


@pytest.mark.parametrize("rank", range(4))
def test_a_2x2_mesh(rank):
    """Ranks {0, 1} and {2, 3} each hold the model cut in two; the groups split the units."""
    p = Placement(world=4, rank=rank, tensor_size=2, n_heads=4, n_kv_heads=2, sharded=True)
    assert (p.kind, p.tensor_rank, p.data_rank, p.data_size) == ("mesh", rank % 2, rank // 2, 2)
    assert list(p.heads()) == [[0, 1], [2, 3]][rank % 2] and list(p.kv_heads()) == [[0], [1]][rank % 2]
    assert p.examples(5) == [[0, 2, 4], [1, 3]][rank // 2] and p.unit_share() == (rank // 2, 2)
    view = p.group_view()  # what adapter.tp shows: the tensor-parallel group alone
    assert (view.world, view.rank, view.data_size, list(view.heads())) == (2, rank % 2, 1, list(p.heads()))


@pytest.mark.parametrize("kwargs,match", [
    ({"world": 0}, "world of at least 1"), ({"world": 2, "rank": 2}, "rank in"), ({"world": 2, "rank": -1}, "rank in"),
    ({"world": 4, "tensor_size": 3}, "must divide the world"), ({"world": 2, "tensor_size": 0}, "must divide"),
    ({"world": 2, "tensor_size": 2, "n_heads": 3}, "as many heads"),
    ({"world": 2, "tensor_size": 2, "n_heads": 4, "n_kv_heads": 1}, "as many heads"),
])
def test_a_placement_that_cannot_be_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Placement(**kwargs)


def test_dtensors_are_told_apart_and_plain_tensors_pass_through():
    t = torch.ones(2)
    assert not is_dtensor(t) and not Placement.is_dtensor(t)
    assert Placement.full(t) is t and Placement.to_local(t) is t and Placement.to_local(None) is None


@pytest.mark.parametrize("value,want", [(False, None), (None, None), (True, TensorParallel()), (2, TensorParallel(2)),
                                        (TensorParallel(4), TensorParallel(4))])
def test_a_tensor_parallel_request_has_one_form(value, want):
    assert TensorParallel.request(value) == want


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", [2]])
def test_a_tensor_parallel_request_that_is_not_one_is_refused_once(value):
    with pytest.raises(ConfigError, match=r"tensor_parallel=.*give True .* or the ranks per group"):
        TensorParallel.request(value)


def test_the_group_size_divides_the_world():
    assert TensorParallel().group_size(6) == 6 and TensorParallel(3).group_size(6) == 3
    with pytest.raises(ConfigError, match="tensor_parallel=4 over 6 ranks"):
        TensorParallel(4).group_size(6)
    with pytest.raises(InputError, match="--tensor-size 4 does not divide the 6 ranks"):
        TensorParallel(4).group_size(6, flag=True)


def test_the_command_line_flags_make_the_same_request():
    assert TensorParallel.from_flags(False, None) is None
    assert TensorParallel.from_flags(True, None) == TensorParallel() and TensorParallel.from_flags(True, 2) == \
        TensorParallel(2)
    with pytest.raises(InputError, match="--tensor-size acts only with --tensor-parallel"):
        TensorParallel.from_flags(False, 2)
    with pytest.raises(InputError, match="--tensor-size must be at least 1.*got 0"):
        TensorParallel.from_flags(True, 0)


def test_an_adapter_carries_the_trivial_placement_when_alone():
    from headlab.models import adapt
    from headlab.models.transformer import Transformer, TransformerConfig

    a = adapt(Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=4)))
    assert a.placement == Placement(n_heads=4, n_kv_heads=4) and a.tp is None
    assert Placement.of(a) == a.placement and not a.placement.sharded


_RANK = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from headlab.distributed.placement import Placement
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    data = Placement.here(n_heads=4, n_kv_heads=2)  # data parallel: each rank its examples, every head
    sharded = Placement(world=w, rank=r, tensor_size=w, n_heads=4, n_kv_heads=2, sharded=True,
                        group=dist.group.WORLD)  # tensor parallel: each rank 2 heads, every example
    own = torch.zeros(1, 4)
    own[0, list(sharded.heads())] = torch.tensor([10.0 * r + 1, 10.0 * r + 2])
    z = torch.full((1, 2, 1), float(r))  # this rank's heads of a site
    out = {"units": data.examples(5), "data_sum": data.sum_over_data(torch.tensor([r + 1.0])).tolist(),
           "data_heads": data.sum_heads(torch.tensor([float(r)])).tolist(),
           "tp_heads": sharded.sum_heads(own).tolist(), "tp_units": sharded.examples(5),
           "tp_count": sharded.sum_over_data(torch.tensor([3.0])).tolist(),
           "gather": sharded.gather(z, "z").flatten().tolist(),
           "rank0": None if (g := sharded.gather(z, "z", to="rank0")) is None else g.flatten().tolist()}
    with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # past gloo's threads at interpreter exit (they can abort a finished rank)
""")


@pytest.mark.distributed
def test_the_sums_on_two_gloo_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), [x[-2000:] for x in logs]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["units"] for g in got] == [[0, 2, 4], [1, 3]]
    for g in got:
        assert g["data_sum"] == [3.0] and g["data_heads"] == [1.0]
        assert g["tp_heads"] == [[1.0, 2.0, 11.0, 12.0]] and g["tp_units"] == [0, 1, 2, 3, 4]
        assert g["tp_count"] == [3.0]  # held alike by the group: not added over it
        assert g["gather"] == [0.0, 0.0, 1.0, 1.0]
    assert got[0]["rank0"] == [0.0, 0.0, 1.0, 1.0] and got[1]["rank0"] is None
