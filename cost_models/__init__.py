"""Alpha-beta-gamma cost models, one module per collective (installed as ``collectives.cost_models``)."""
