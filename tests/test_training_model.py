"""Data-parallel training performance model: formulas against hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest

from collectives.cost_models.training import cli as training_cli
from collectives.cost_models.training import (
    Blocking,
    Cluster,
    Gemm,
    Link,
    Node,
    allreduce_time,
    layer_gemms,
    mesh_dims,
    predict,
)
from collectives.cost_models.training.clusters import calibrated, skylake
from collectives.cost_models.training.networks import Layer, fc_network, from_torch, get_network

# A two-layer FC network 4 -> 3 -> 2 at batch 2 on a node of 1000 flop/s and
# 100 B/s with the unblocked intensity: every GEMM is memory-bound, so its
# time is bytes / 100 with bytes = 4 (mk + kn + 2mn):
#   layer 1 FP    m=3 n=2 k=4  (12 + 8 + 12) words = 128 B -> 1.28 s
#   layer 1 BP-WU m=3 n=4 k=2  ( 6 + 8 + 24) words = 152 B -> 1.52 s
#   layer 1 BP-GC not computed (first layer)
#   layer 2 FP    m=2 n=2 k=3  ( 6 + 6 +  8) words =  80 B -> 0.80 s
#   layer 2 BP-GC m=3 n=2 k=2  ( 6 + 4 + 12) words =  88 B -> 0.88 s
#   layer 2 BP-WU m=2 n=3 k=2  ( 4 + 6 + 12) words =  88 B -> 0.88 s
# Gradients: layer 1 has 3*4+3 = 15 parameters (60 B), layer 2 2*3+2 = 8 (32 B).
NET = fc_network([4, 3, 2])
NODE = Node("toy", peak_flops=1000.0, mem_bandwidth=100.0, blocking=None)
LINK = Link(alpha=1.0, beta=0.01, gamma=0.001)
TOY = Cluster("toy", NODE, LINK, 16)
COMPUTE = 1.28 + 1.52 + 0.80 + 0.88 + 0.88


def mst(n: float, steps: int) -> float:
    return steps * (2 * LINK.alpha + n * (2 * LINK.beta + LINK.gamma))


def test_fc_gemm_shapes_follow_the_paper():
    g = layer_gemms(NET.layers[0], batch=2)
    assert (g["fp"].m, g["fp"].n, g["fp"].k) == (3, 2, 4)  # n_l x b = (n_l x n_{l-1})(n_{l-1} x b)
    assert (g["bp_gc"].m, g["bp_gc"].n, g["bp_gc"].k) == (4, 2, 3)
    assert (g["bp_wu"].m, g["bp_wu"].n, g["bp_wu"].k) == (3, 4, 2)
    assert g["fp"].flops == 48


def test_conv_gemms_through_im2col():
    conv = Layer("conv", "c", 3, 4, (3, 3), (8, 8), (8, 8))
    g = layer_gemms(conv, batch=2)
    assert (g["fp"].m, g["fp"].n, g["fp"].k) == (4, 128, 27)
    assert (g["bp_gc"].m, g["bp_gc"].n, g["bp_gc"].k) == (27, 128, 4)
    assert (g["bp_wu"].m, g["bp_wu"].n, g["bp_wu"].k) == (4, 27, 128)
    grouped = layer_gemms(Layer("conv", "g", 4, 8, (3, 3), (8, 8), (8, 8), groups=2), batch=1)["fp"]
    assert (grouped.m, grouped.n, grouped.k, grouped.count) == (4, 64, 18, 2)
    assert layer_gemms(Layer("pool", "p", 4, 4, (2, 2), (8, 8), (4, 4)), 2) == {}


def test_blocked_and_unblocked_intensity():
    g = Gemm(3, 2, 4)
    assert g.traffic(None) == 4 * (12 + 8 + 12)
    # blocks 2 x 2 x 2: B once (8), A ceil(2/2)=1 time (12), C 2 * ceil(4/2)=2 times (2*6*2=24)
    assert g.traffic(Blocking(mc=2, nc=2, kc=2)) == 4 * (8 + 12 + 24)
    big = Gemm(4800, 30720, 3840)
    blocked = big.intensity(Blocking())
    expected = 2 * 4800 * 30720 * 3840 / (4 * (3840 * 30720 + 4800 * 3840 * 10 + 2 * 4800 * 30720 * 10))
    assert blocked == pytest.approx(expected)
    assert blocked < big.intensity(None)


def test_roofline_time():
    fast = Node("n", peak_flops=100.0, mem_bandwidth=1e9, blocking=None)
    assert fast.gemm_time(Gemm(3, 2, 4)) == pytest.approx(48 / 100.0)  # compute-bound
    assert NODE.gemm_time(Gemm(3, 2, 4)) == pytest.approx(1.28)  # memory-bound


def test_allreduce_formulas_star_and_mesh():
    n = 60
    assert allreduce_time(n, 4, LINK, "mst", "star")[0] == pytest.approx(mst(n, 2))
    bkt_star = 2 * 3 * LINK.alpha + 3 / 4 * n * (2 * LINK.beta + LINK.gamma)
    assert allreduce_time(n, 4, LINK, "bkt", "star")[0] == pytest.approx(bkt_star)
    # 2 x 2 mesh: MST log2(2) + log2(2) steps; BKT dimension 1 with n, dimension 2 with n/2
    assert allreduce_time(n, 4, LINK, "mst", "mesh")[0] == pytest.approx(mst(n, 2))
    bkt_mesh = 4 * LINK.alpha + (n / 2 + n / 4) * (2 * LINK.beta + LINK.gamma)
    assert allreduce_time(n, 4, LINK, "bkt", "mesh")[0] == pytest.approx(bkt_mesh)
    assert allreduce_time(n, 4, LINK, "auto", "star") == (pytest.approx(mst(n, 2)), "mst")
    # non-power of two: ceil(log2 5) = 3 steps
    assert allreduce_time(n, 5, LINK, "mst", "star")[0] == pytest.approx(mst(n, 3))
    # large messages: BKT wins on bandwidth
    assert allreduce_time(1e6, 4, LINK, "auto", "star")[1] == "bkt"
    assert allreduce_time(n, 1, LINK, "auto", "star") == (0.0, "none")
    with pytest.raises(ValueError):
        allreduce_time(n, 4, LINK, "ring", "star")
    with pytest.raises(ValueError):
        allreduce_time(n, 4, LINK, "mst", "torus")


def test_library_allreduce_models_star_and_mesh():
    from collectives.cost_models import predict as cost

    P = LINK.cost_params()
    n = 4000
    for name in ("mst", "ring", "recursive_doubling", "rabenseifner"):
        got = allreduce_time(n, 8, LINK, name, "star", models="library")
        assert got == (pytest.approx(cost("allreduce", name, 8, n, P)), name)
    assert allreduce_time(n, 8, LINK, "bkt", "star", models="library")[1] == "ring"
    # the bucket ring on the paper's star is exactly its BKT formula
    assert allreduce_time(n, 8, LINK, "bkt", "star", models="library")[0] == pytest.approx(
        allreduce_time(n, 8, LINK, "bkt", "star")[0])
    # 3 x 4 mesh: the ring reduce-scatters along each dimension on a shrinking share, then allgathers
    ring_mesh = (cost("reduce_scatter", "ring", 3, n, P) + cost("allgather", "ring", 3, n, P)
                 + cost("reduce_scatter", "ring", 4, n // 3, P) + cost("allgather", "ring", 4, n // 3, P))
    assert allreduce_time(n, 12, LINK, "ring", "mesh", models="library")[0] == pytest.approx(ring_mesh)
    rd_mesh = cost("allreduce", "recursive_doubling", 3, n, P) + cost("allreduce", "recursive_doubling", 4, n, P)
    assert allreduce_time(n, 12, LINK, "recursive_doubling", "mesh", models="library")[0] == pytest.approx(rd_mesh)
    best = min(allreduce_time(n, 8, LINK, a, "star", models="library") for a in ("mst", "ring", "recursive_doubling",
                                                                               "rabenseifner"))
    assert allreduce_time(n, 8, LINK, "auto", "star", models="library") == best
    with pytest.raises(ValueError):
        allreduce_time(n, 8, LINK, "shared_window", "star", models="library")
    with pytest.raises(ValueError):
        allreduce_time(n, 8, LINK, "mst", "star", models="guess")


def test_measured_layer_times_replace_the_roofline():
    times = [(0.5, 0.0, 0.25), (0.125, 0.25, 0.125)]
    one = predict(NET, TOY, 1, 2, layer_times=times)
    assert one.compute == pytest.approx(1.25) and one.step == pytest.approx(1.25)
    on = predict(NET, TOY, 4, 2, layer_times=times)
    assert on.layers[1].allreduce_start == pytest.approx(0.5 + 0.125 + 0.125)  # forward, then layer 2's BP-WU
    with pytest.raises(ValueError):
        predict(NET, TOY, 1, 2, layer_times=times[:1])


def test_mesh_dims():
    assert mesh_dims(4) == (2, 2)
    assert mesh_dims(12) == (3, 4)
    assert mesh_dims(7) == (1, 7)
    assert mesh_dims(1000) == (25, 40)


def test_two_layer_fc_step_with_and_without_overlap():
    one = predict(NET, TOY, 1, 2)
    assert one.compute == pytest.approx(COMPUTE)
    assert one.communication == 0 and one.step == pytest.approx(COMPUTE) and one.efficiency == 1.0

    ar1, ar2 = mst(60, 2), mst(32, 2)  # auto picks MST for both layers at P=4
    on = predict(NET, TOY, 4, 2, allreduce="auto", overlap=True)
    assert [c.algorithm for c in on.layers] == ["mst", "mst"]
    assert on.communication == pytest.approx(ar1 + ar2)
    # forward 1.28 + 0.80; layer 2 BP-WU ends at 2.96: its allreduce runs 2.96 .. 2.96 + ar2;
    # layer 2 BP-GC, layer 1 BP-WU end at 5.36; layer 1's allreduce waits for the network.
    assert on.layers[1].allreduce_start == pytest.approx(2.96)
    assert on.layers[0].allreduce_start == pytest.approx(2.96 + ar2)
    assert on.step == pytest.approx(2.96 + ar2 + ar1)
    assert on.exposed_communication == pytest.approx(on.step - COMPUTE)
    assert on.images_per_second == pytest.approx(4 * 2 / on.step)
    assert on.efficiency == pytest.approx(COMPUTE / on.step)
    assert on.bound == "communication"

    off = predict(NET, TOY, 4, 2, allreduce="auto", overlap=False)
    assert off.step == pytest.approx(COMPUTE + ar1 + ar2)
    assert off.step > on.step


def test_fully_hidden_communication_is_compute_bound():
    fast_link = Cluster("fast", NODE, Link(1e-6, 1e-6), 16)
    r = predict(NET, fast_link, 2, 2)
    assert r.bound == "compute"
    assert r.exposed_communication == pytest.approx(r.layers[0].allreduce, rel=1e-9)  # only layer 1's is exposed
    assert r.step == pytest.approx(COMPUTE + r.layers[0].allreduce)


def test_builtin_networks_have_the_papers_layer_counts():
    expected = {"alexnet": (3, 5, 3), "vgg16": (3, 13, 5), "resnet50": (1, 53, 1), "inception3": (1, 94, 14)}
    for name, (fc, conv, pool) in expected.items():
        assert get_network(name).counts() == {"fc": fc, "conv": conv, "pool": pool}
    assert get_network("vgg16").params == 138_357_544
    assert get_network("resnet50").layers[-2].out_size == (7, 7)
    assert get_network("inception3").layers[-2].in_size == (8, 8)


@pytest.mark.parametrize("net", ["alexnet", "vgg16", "resnet50", "inception3"])
def test_papers_conclusions_on_the_skylake_cluster(net):
    cluster, network = skylake(), get_network(net)
    overlapped = predict(network, cluster, 1000, 60, overlap=True)
    serial = predict(network, cluster, 1000, 60, overlap=False)
    assert overlapped.bound == "compute"  # compute-bound at batch 60 per node
    assert overlapped.step < serial.step  # overlap lowers step time
    faster = predict(network, cluster.with_link(gbits_per_s=400), 1000, 60)
    assert faster.communication < overlapped.communication  # bandwidth shortens the collectives
    for topology in ("star", "mesh"):
        assert predict(network, cluster, 64, 60, topology=topology, allreduce="bkt").communication > 0


def test_parse_nodes():
    assert training_cli.parse_nodes("1,2,4,...,1000") == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    assert training_cli.parse_nodes("10,15,...,30") == [10, 15, 20, 25, 30]
    assert training_cli.parse_nodes("3") == [3]
    with pytest.raises(ValueError):
        training_cli.parse_nodes("0,1")


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = training_cli.main(["--net", "alexnet", "--nodes", "1,2,4", "--topology", "mesh", "--allreduce", "bkt",
                            "--no-overlap", "--json", str(out), "--layers"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "3 FC / 5 CONV / 3 POOL" in text and "images/s" in text
    data = json.loads(out.read_text())
    assert [r["nodes"] for r in data["results"]] == [1, 2, 4]
    assert data["results"][2]["overlap"] is False and len(data["results"][2]["layers"]) == 11


def test_calibrated_preset_builds(tmp_path, monkeypatch):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"alpha": 0.0, "beta": 2e-10, "gamma": 3e-11, "overhead": 2e-6,
                                   "protocol": [[8192, 8e-6, 1e-9]]}))
    monkeypatch.setenv("COLLECTIVES_PROFILE", str(profile))
    c = calibrated(nodes=2, node=Node("given", 1e10, 1e10))
    assert c.link.alpha == pytest.approx(10e-6) and c.link.beta == 2e-10  # small-message latency + overhead
    assert math.isfinite(predict(NET, c, 2, 4).step)
    # the library's models price the allreduces with the whole profile (here its per-message overhead)
    assert c.link.cost_params().overhead == 2e-6
    lib = predict(NET, c, 2, 4, models="library")
    assert lib.models == "library" and all(layer.algorithm != "bkt" for layer in lib.layers)


def test_from_torch():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False), torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )
    net = from_torch(model, torch.zeros(5, 3, 8, 8), name="toy")
    assert net.counts() == {"fc": 1, "conv": 2, "pool": 2}
    conv1, pool, conv2, gap, fc = net.layers
    assert (conv1.in_channels, conv1.out_channels, conv1.kernel, conv1.in_size, conv1.out_size) == (3, 8, (3, 3), (8, 8), (8, 8))
    assert pool.out_size == (4, 4) and gap.kernel == (2, 2) and gap.out_size == (2, 2)
    assert conv2.groups == 2 and conv2.params == 8 * 4 * 9
    assert (fc.in_channels, fc.out_channels) == (32, 10)
    assert net.params == sum(p.numel() for p in model.parameters())
    assert net.input_shape == (3, 8, 8)


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    assert training_cli.main(["--net", "resnet50", "--nodes", "1,2,4,...,64", "--plot", str(out)]) == 0
    assert out.stat().st_size > 0
