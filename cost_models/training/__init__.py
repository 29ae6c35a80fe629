"""The training performance model: step time of data-parallel CNN training on P nodes.

One module per job:

=================  ===========================================================
``model``          one training step: compute and allreduces per layer, their
                   overlap; :func:`~.model.predict` and :func:`~.model.scan`
``compute``        a node's compute: the GEMMs of a layer by the roofline
``communication``  links and the gradient allreduces (MST, BKT, the library's)
``networks``       layer tables of CNNs (built in, or from a torch module)
``clusters``       machines: the paper's Skylake cluster, this machine calibrated
``cli``            ``collectives model``
=================  ===========================================================

The public names of every module but ``cli`` are importable from here
(``from collectives.cost_models.training import predict, get_network,
get_cluster``); see ``docs/training-model.md``.
"""

from .clusters import FALLBACK_LINK, PRESETS, calibrated, get_cluster, measure_node, profile_link, skylake
from .communication import (ALLREDUCE_MODELS, LIBRARY_ALLREDUCES, MODEL_SETS, TOPOLOGIES, Link, allreduce_time,
                            mesh_dims)
from .compute import SKYLAKE_BLOCKING, WORD_BYTES, Blocking, Gemm, Node, layer_gemms
from .model import PHASES, Cluster, LayerCost, StepPrediction, predict, scan, schedule
from .networks import (KINDS, NETWORKS, Layer, Network, alexnet, fc_network, from_torch, get_network, inception3,
                       resnet50, vgg16)

__all__ = [
    # the model
    "Blocking", "SKYLAKE_BLOCKING", "Gemm", "Node", "Link", "Cluster", "LayerCost", "StepPrediction",
    "layer_gemms", "mesh_dims", "allreduce_time", "ALLREDUCE_MODELS", "LIBRARY_ALLREDUCES", "MODEL_SETS",
    "TOPOLOGIES", "PHASES", "WORD_BYTES", "schedule", "predict", "scan",
    # networks
    "Layer", "Network", "NETWORKS", "KINDS", "get_network", "alexnet", "vgg16", "resnet50", "inception3",
    "fc_network", "from_torch",
    # clusters
    "skylake", "calibrated", "measure_node", "profile_link", "FALLBACK_LINK", "PRESETS", "get_cluster",
]
